package maps

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/features"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"
)

// KernelFeature is one kernel capability the datapath uses.
type KernelFeature struct {
	// Name is how README's requirements table and the logs call it.
	Name string `json:"name"`
	// Since is the first Linux release that has it.
	Since string `json:"since"`
	// Present says whether the running kernel has it.
	Present bool `json:"present"`
	// Without is what the datapath does on a kernel without it; empty
	// when it cannot run without it.
	Without string `json:"without,omitempty"`
	// Forced says the kernel has it but Options.ForceFallbacks made the
	// datapath do without it (Present is false).
	Forced bool `json:"forced,omitempty"`
	// Path is the way the datapath works that Load chose for this
	// feature (for tcx links: "tcx" or "tc"), given the kernel and the
	// options; empty for features without a choice.
	Path string `json:"path,omitempty"`
}

// KernelReport is what ProbeKernel found on the running kernel.
type KernelReport struct {
	// Release is uname -r.
	Release string `json:"release"`
	// Features are sorted by name.
	Features []KernelFeature `json:"features"`
}

// ErrKernelFeature is wrapped by the error of a kernel that lacks a
// feature the datapath cannot run without.
var ErrKernelFeature = errors.New("kernel lacks a feature topolb needs")

// Err names each absent feature without a fallback and the first release
// that has it; nil when there is none.
func (r KernelReport) Err() error {
	var missing []string
	for _, f := range r.Features {
		if !f.Present && f.Without == "" {
			missing = append(missing, fmt.Sprintf("%s (Linux %s)", f.Name, f.Since))
		}
	}
	if len(missing) == 0 {
		return nil
	}
	return fmt.Errorf("kernel %s: %w: %s", r.Release, ErrKernelFeature, strings.Join(missing, ", "))
}

// LogArgs is the report as log attributes: the release and, per
// feature, "yes" or "no: <what happens without it>".
func (r KernelReport) LogArgs() []any {
	args := []any{"release", r.Release}
	for _, f := range r.Features {
		v := "yes"
		switch {
		case !f.Present && f.Without == "":
			v = "no: needs Linux " + f.Since
		case f.Forced:
			v = "forced off: " + f.Without
		case !f.Present:
			v = "no: " + f.Without
		}
		if f.Path != "" {
			v += "; path " + f.Path
		}
		args = append(args, f.Name, v)
	}
	return args
}

// fibLookupSrc is BPF_FIB_LOOKUP_SRC (include/uapi/linux/bpf.h).
const fibLookupSrc = 1 << 4

// ProbeKernel finds which of the features the programs of specs use the
// running kernel has: every helper they call, tcx links,
// BPF_FIB_LOOKUP_SRC, and what the agent uses besides: lookup-and-delete
// on hash maps and SO_NETNS_COOKIE.
func ProbeKernel(specs ...*ebpf.CollectionSpec) (KernelReport, error) {
	if err := allowBPFMemory(); err != nil {
		return KernelReport{}, err
	}
	var uts unix.Utsname
	if err := unix.Uname(&uts); err != nil {
		return KernelReport{}, fmt.Errorf("uname: %w", err)
	}
	r := KernelReport{Release: unix.ByteSliceToString(uts.Release[:])}

	type use struct {
		typ ebpf.ProgramType
		fn  asm.BuiltinFunc
	}
	uses := map[use]bool{}
	for _, spec := range specs {
		for _, p := range spec.Programs {
			for _, ins := range p.Instructions {
				if ins.IsBuiltinCall() {
					uses[use{p.Type, asm.BuiltinFunc(ins.Constant)}] = true
				}
			}
		}
	}
	seen := map[string]int{}
	for u := range uses {
		err := features.HaveProgramHelper(u.typ, u.fn)
		if err != nil && !errors.Is(err, ebpf.ErrNotSupported) {
			return r, fmt.Errorf("probe helper %s for %s programs: %w", u.fn, u.typ, err)
		}
		name := "helper " + helperName(u.fn)
		h, ok := newHelpers[u.fn]
		if !ok {
			h.since = "5.10"
		}
		if i, ok := seen[name]; ok {
			// One helper in several program types: absent if absent in any.
			r.Features[i].Present = r.Features[i].Present && err == nil
			continue
		}
		seen[name] = len(r.Features)
		r.Features = append(r.Features, KernelFeature{Name: name, Since: h.since, Present: err == nil, Without: h.without})
	}

	tcx, err := probeTCX()
	if err != nil {
		return r, err
	}
	r.Features = append(r.Features, KernelFeature{Name: featureTCX, Since: "6.6", Present: tcx,
		Without: "tc programs are attached as direct-action filters of a clsact qdisc (netlink)"})
	for _, f := range compatFeatures {
		present, err := f.probe()
		if err != nil {
			return r, err
		}
		r.Features = append(r.Features, KernelFeature{Name: f.name, Since: f.since, Present: present, Without: f.without})
	}
	sort.Slice(r.Features, func(i, j int) bool { return r.Features[i].Name < r.Features[j].Name })
	return r, nil
}

// helperName is the helper's name as the C source spells it.
func helperName(fn asm.BuiltinFunc) string {
	return "bpf_" + camelToSnake(strings.TrimPrefix(fn.String(), "Fn"))
}

func camelToSnake(s string) string {
	var b strings.Builder
	for i, c := range s {
		if c >= 'A' && c <= 'Z' {
			if i > 0 {
				b.WriteByte('_')
			}
			c += 'a' - 'A'
		}
		b.WriteRune(c)
	}
	return b.String()
}

// featureTCX names tcx links in the report.
const featureTCX = "tcx links"

// chooseTCAttach resolves want (Options.TCAttach) against the kernel:
// TCAttachAuto takes tcx where the kernel has it and tc clsact filters
// elsewhere; TCAttachTCX on a kernel without tcx is an error naming the
// feature. It records the choice as the tcx feature's Path.
func (r *KernelReport) chooseTCAttach(want TCAttach) (TCAttach, error) {
	i := slices.IndexFunc(r.Features, func(f KernelFeature) bool { return f.Name == featureTCX })
	if i < 0 {
		return "", fmt.Errorf("kernel report has no %q feature", featureTCX)
	}
	f := &r.Features[i]
	got := want
	switch {
	case want == TCAttachTCX && !f.Present:
		return "", fmt.Errorf("kernel %s: %w: %s (Linux %s), which the tc attach option (--tc-attach=tcx) asks for", r.Release, ErrKernelFeature, f.Name, f.Since)
	case want == TCAttachAuto && f.Present:
		got = TCAttachTCX
	case want == TCAttachAuto:
		got = TCAttachTC
	}
	f.Path = string(got)
	return got, nil
}

// probeTCX attaches a do-nothing program to an interface index that does
// not exist: a kernel with tcx says ENODEV, one without it does not know
// the attach type.
func probeTCX() (bool, error) {
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type: ebpf.SchedCLS, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()},
	})
	if err != nil {
		return false, fmt.Errorf("probe tcx: load program: %w", err)
	}
	defer prog.Close()
	l, err := link.AttachTCX(link.TCXOptions{Interface: math.MaxInt32, Program: prog, Attach: ebpf.AttachTCXIngress})
	if err == nil {
		l.Close()
		return false, errors.New("probe tcx: attached to an interface that cannot exist")
	}
	return !errors.Is(err, ebpf.ErrNotSupported), nil
}

// probeFIBLookupSrc runs a tc program that asks bpf_fib_lookup for an
// IPv4 route's source address through lo: a kernel without the flag
// rejects it with -EINVAL before looking anything up.
func probeFIBLookupSrc() (bool, error) {
	const size = 64 // sizeof(struct bpf_fib_lookup)
	insns := asm.Instructions{asm.Mov.Reg(asm.R6, asm.R1)}
	for off := int16(-size); off < 0; off += 4 {
		insns = append(insns, asm.StoreImm(asm.R10, off, 0, asm.Word))
	}
	insns = append(insns,
		asm.StoreImm(asm.R10, -size, unix.AF_INET, asm.Byte), // family
		asm.StoreImm(asm.R10, -size+8, 1, asm.Word),          // ifindex: lo
		asm.Mov.Reg(asm.R1, asm.R6),
		asm.Mov.Reg(asm.R2, asm.R10),
		asm.Add.Imm(asm.R2, -size),
		asm.Mov.Imm(asm.R3, size),
		asm.Mov.Imm(asm.R4, fibLookupSrc),
		asm.FnFibLookup.Call(),
		asm.Return(),
	)
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.SchedCLS, License: "GPL", Instructions: insns})
	if err != nil {
		return false, fmt.Errorf("probe BPF_FIB_LOOKUP_SRC: load program: %w", err)
	}
	defer prog.Close()
	ret, err := prog.Run(&ebpf.RunOptions{Data: make([]byte, 64)})
	if err != nil {
		return false, fmt.Errorf("probe BPF_FIB_LOOKUP_SRC: run: %w", err)
	}
	return int32(ret) != -int32(unix.EINVAL), nil
}

// probeDatapathKernel probes the features of the datapath's objects, tc's
// already parsed.
func probeDatapathKernel(tcSpec *ebpf.CollectionSpec) (KernelReport, error) {
	specs := []*ebpf.CollectionSpec{tcSpec}
	for _, load := range []func() (*ebpf.CollectionSpec, error){loadXdp, loadUplink, loadSock} {
		spec, err := load()
		if err != nil {
			return KernelReport{}, err
		}
		specs = append(specs, spec)
	}
	return ProbeKernel(specs...)
}

// Kernel returns what Load found the kernel offers.
func (d *Datapath) Kernel() KernelReport { return d.kernel }

// allowBPFMemory lifts RLIMIT_MEMLOCK where the kernel still charges BPF
// maps and programs to it (before 5.11; later kernels charge the memory
// cgroup and this does nothing): the default 64 KiB does not hold a
// single conntrack table.
func allowBPFMemory() error {
	if err := rlimit.RemoveMemlock(); err != nil {
		return fmt.Errorf("lift RLIMIT_MEMLOCK for BPF maps (Linux < 5.11 charges them to it): %w", err)
	}
	return nil
}
