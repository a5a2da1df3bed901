package maps

import (
	"errors"
	"strconv"
	"strings"
	"testing"
)

// releaseAtLeast says whether a uname release such as "5.10.0-32-amd64"
// is at or past "major.minor".
func releaseAtLeast(t *testing.T, release, since string) bool {
	t.Helper()
	parse := func(s string) (int, int) {
		f := strings.FieldsFunc(s, func(r rune) bool { return r < '0' || r > '9' })
		if len(f) < 2 {
			t.Fatalf("cannot read a version from %q", s)
		}
		major, err1 := strconv.Atoi(f[0])
		minor, err2 := strconv.Atoi(f[1])
		if err := errors.Join(err1, err2); err != nil {
			t.Fatalf("version %q: %v", s, err)
		}
		return major, minor
	}
	rm, rn := parse(release)
	sm, sn := parse(since)
	return rm > sm || rm == sm && rn >= sn
}

// TestProbeKernel checks every probe against the release it runs on: a
// feature is found exactly where the kernel is at least the release that
// introduced it (the kernel matrix, tools/kernels, runs this on 5.10, 6.1,
// 6.12 and the machine's kernel). Every helper the objects call is
// probed, and the error names each feature missing without a fallback
// with its release.
func TestProbeKernel(t *testing.T) {
	requirePrivileges(t)
	tcSpec, err := loadTc()
	if err != nil {
		t.Fatal(err)
	}
	r, err := probeDatapathKernel(tcSpec)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("kernel %s: %v", r.Release, r.LogArgs())
	names := map[string]bool{}
	for _, f := range r.Features {
		names[f.Name] = true
		if want := releaseAtLeast(t, r.Release, f.Since); f.Present != want {
			t.Errorf("%s (Linux %s): probe says present=%v on %s", f.Name, f.Since, f.Present, r.Release)
		}
	}
	for _, want := range []string{"tcx links", "BPF_FIB_LOOKUP_SRC", "helper bpf_ktime_get_coarse_ns", "helper bpf_fib_lookup", "helper bpf_set_retval"} {
		if !names[want] {
			t.Errorf("no feature %q in %v", want, r.LogArgs())
		}
	}
	err = r.Err()
	for _, f := range r.Features {
		named := err != nil && strings.Contains(err.Error(), f.Name+" (Linux "+f.Since+")")
		if blocking := !f.Present && f.Without == ""; named != blocking {
			t.Errorf("%s: absent without fallback %v, named in the error %v: %v", f.Name, blocking, named, err)
		}
	}
	if err != nil && !errors.Is(err, ErrKernelFeature) {
		t.Errorf("error %v does not wrap ErrKernelFeature", err)
	}
}

// TestKernelReportErr: the error names every feature absent without a
// fallback and the release that brought it, and nothing else.
func TestKernelReportErr(t *testing.T) {
	for _, c := range []struct {
		name     string
		features []KernelFeature
		want     string // "" for no error
	}{
		{"all present", []KernelFeature{{Name: "tcx links", Since: "6.6", Present: true}}, ""},
		{"absent with fallback", []KernelFeature{{Name: "BPF_FIB_LOOKUP_SRC", Since: "6.7", Without: "dropped"}}, ""},
		{"absent without fallback", []KernelFeature{
			{Name: "BPF_FIB_LOOKUP_SRC", Since: "6.7", Without: "dropped"},
			{Name: "helper bpf_check_mtu", Since: "5.12"},
			{Name: "tcx links", Since: "6.6"},
		}, "kernel 5.10.0-32-amd64: kernel lacks a feature topolb needs: helper bpf_check_mtu (Linux 5.12), tcx links (Linux 6.6)"},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := KernelReport{Release: "5.10.0-32-amd64", Features: c.features}.Err()
			switch {
			case c.want == "" && err != nil:
				t.Errorf("error %v, want none", err)
			case c.want != "" && (err == nil || err.Error() != c.want || !errors.Is(err, ErrKernelFeature)):
				t.Errorf("error %v, want %q wrapping ErrKernelFeature", err, c.want)
			}
		})
	}
}
