package maps

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/cilium/ebpf/btf"
)

// kernelEnumValues returns the names of every enum value in the running
// kernel's BTF: the uapi it was built with, backports included.
func kernelEnumValues(t *testing.T) map[string]bool {
	t.Helper()
	spec, err := btf.LoadKernelSpec()
	if err != nil {
		t.Skipf("kernel BTF unavailable (CONFIG_DEBUG_INFO_BTF): %v", err)
	}
	out := map[string]bool{}
	for typ, err := range spec.All() {
		if err != nil {
			t.Fatalf("read kernel BTF: %v", err)
		}
		if e, ok := typ.(*btf.Enum); ok {
			for _, v := range e.Values {
				out[v.Name] = true
			}
		}
	}
	return out
}

// btfName is the uapi enum value whose presence in the kernel's BTF says
// it has feature f: BPF_FUNC_<helper>, BPF_TCX_INGRESS, the flag itself;
// "" for a feature no enum value stands for (checked by release).
func btfName(t *testing.T, f KernelFeature) string {
	t.Helper()
	if h, ok := strings.CutPrefix(f.Name, "helper bpf_"); ok {
		return "BPF_FUNC_" + h
	}
	switch f.Name {
	case "tcx links":
		return "BPF_TCX_INGRESS"
	case "BPF_FIB_LOOKUP_SRC":
		return "BPF_FIB_LOOKUP_SRC"
	case featureLookupAndDelete, featureNetnsCookie, featureCmpXchg:
		return ""
	}
	t.Fatalf("feature %q has no BTF name to check it against", f.Name)
	return ""
}

// TestProbeKernel checks every probe against the kernel's own BTF: a
// feature is found exactly where the kernel was built with its uapi value
// (the kernel matrix, tools/kernels, runs this on 5.10, 6.1, 6.12 and the
// machine's kernel). Not against the release: Debian's 6.1 has
// BPF_FIB_LOOKUP_SRC, a 6.7 feature, backported. Every helper the objects
// call is probed, and the error names each feature missing without a
// fallback with its release.
func TestProbeKernel(t *testing.T) {
	requirePrivileges(t)
	r := probeKernel(t)
	t.Logf("kernel %s: %v", r.Release, r.LogArgs())
	inBTF := kernelEnumValues(t)
	names := map[string]bool{}
	for _, f := range r.Features {
		names[f.Name] = true
		name := btfName(t, f)
		if name == "" {
			if want := releaseAtLeast(t, r.Release, f.Since); f.Present != want {
				t.Errorf("%s (Linux %s): probe says present=%v on %s", f.Name, f.Since, f.Present, r.Release)
			}
			continue
		}
		if want := inBTF[name]; f.Present != want {
			t.Errorf("%s (Linux %s): probe says present=%v on %s, its BTF has %s: %v", f.Name, f.Since, f.Present, r.Release, name, want)
		}
	}
	for _, want := range []string{"tcx links", "BPF_FIB_LOOKUP_SRC", "helper bpf_ktime_get_coarse_ns", "helper bpf_fib_lookup", "helper bpf_set_retval",
		"helper bpf_ktime_get_ns", featureLookupAndDelete, featureNetnsCookie, featureCmpXchg, featureForEachMapElem} {
		if !names[want] {
			t.Errorf("no feature %q in %v", want, r.LogArgs())
		}
	}
	err := r.Err()
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

// releaseAtLeast says whether release (uname -r) is since ("major.minor")
// or later.
func releaseAtLeast(t *testing.T, release, since string) bool {
	t.Helper()
	var maj, min, wantMaj, wantMin int
	if _, err := fmt.Sscanf(release, "%d.%d", &maj, &min); err != nil {
		t.Fatalf("release %q: %v", release, err)
	}
	if _, err := fmt.Sscanf(since, "%d.%d", &wantMaj, &wantMin); err != nil {
		t.Fatalf("since %q: %v", since, err)
	}
	return maj > wantMaj || maj == wantMaj && min >= wantMin
}

// probeKernel probes the running kernel for the datapath's objects.
func probeKernel(t testing.TB) KernelReport {
	t.Helper()
	tcSpec, err := loadTc()
	if err != nil {
		t.Fatal(err)
	}
	r, err := probeDatapathKernel(tcSpec)
	if err != nil {
		t.Fatal(err)
	}
	return r
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
