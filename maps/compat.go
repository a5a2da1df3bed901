package maps

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/features"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// The fallbacks for kernels older than a feature the datapath uses
// (Linux 5.10 is the oldest supported; README, "Requirements"). The BPF
// side is bpf/compat.h: each fallback there has a knob, a volatile const
// set here at load from the kernel report, so the verifier never sees a
// helper the kernel lacks.

// newHelper is a helper newer than 5.10 that the objects call.
type newHelper struct {
	// since is the first release that has it.
	since string
	// knob is the bpf/compat.h constant that makes the programs do
	// without it.
	knob string
	// without is what they do then (KernelFeature.Without).
	without string
}

// newHelpers are the helpers the objects call that 5.10 lacks; the others
// are in 5.10 (TestProbeKernel checks both on every kernel of the matrix).
var newHelpers = map[asm.BuiltinFunc]newHelper{
	asm.FnKtimeGetCoarseNs: {"5.11", tcVarCfgNoCoarseClock,
		"the datapath's clock is CLOCK_MONOTONIC (bpf_ktime_get_ns), and the agent's expiry math reads the same"},
	asm.FnCheckMtu: {"5.12", tcVarCfgNoCheckMtu,
		fmt.Sprintf("a forwarded packet is checked against the MTU its egress interface had when the agent loaded the programs (of the first %d interfaces with a global address), else by a FIB lookup per packet (XDP: the route's MTU; tc: the egress device's, once the next hop's neighbour entry exists; an IPv6 packet is let through); a GSO packet's segments are not checked", compatSrcMax)},
	asm.FnXdpStoreBytes: {"5.18", tcVarCfgNoXdpStoreBytes,
		"XDP writes its reject replies into the frame byte by byte"},
	asm.FnSetRetval: {"5.18", tcVarCfgNoSetRetval,
		"a socket hook that refuses a call fails it with EPERM, not ECONNREFUSED (reject frontends) or ENOMEM (full map)"},
}

// Names of the features that are not helpers (KernelFeature.Name).
const (
	featureFIBLookupSrc    = "BPF_FIB_LOOKUP_SRC"
	featureLookupAndDelete = "lookup-and-delete on hash maps"
	featureNetnsCookie     = "SO_NETNS_COOKIE"
	featureCmpXchg         = "BPF atomic compare-and-exchange"
	// featureForEachMapElem is a helper, but of the agent's own program
	// (ct_mark_stale, run with BPF_PROG_TEST_RUN), not the datapath's:
	// no program of the datapath calls it, so it has no knob.
	featureForEachMapElem = "helper bpf_for_each_map_elem"
)

// compatFeatures are the features besides helpers and tcx links that
// ProbeKernel probes, each with its fallback.
var compatFeatures = []struct {
	name, since, without string
	probe                func() (bool, error)
}{
	{featureFIBLookupSrc, "6.7", fibLookupSrcWithout, probeFIBLookupSrc},
	{featureLookupAndDelete, "5.14", lookupAndDeleteWithout, probeLookupAndDelete},
	{featureCmpXchg, "5.12", cmpXchgWithout, probeCmpXchg},
	{featureNetnsCookie, "5.14", netnsCookieWithout, probeNetnsCookie},
	{featureForEachMapElem, "5.13", forEachMapElemWithout, probeForEachMapElem},
}

// compatSrcMax is COMPAT_SRC_MAX in bpf/compat.h: how many interfaces'
// source addresses the programs hold. Change both together.
const compatSrcMax = 8

// fibLookupSrcWithout is what the datapath does without BPF_FIB_LOOKUP_SRC.
var fibLookupSrcWithout = fmt.Sprintf("the source address of a flow source-NATed to a backend on another node is the egress interface's address of the flow's family as the agent read it when it loaded the programs (IPv4: its primary address; IPv6: the one the kernel prefers towards a global destination; of the first %d interfaces with a global address; a change needs an agent restart); none there: the flow is dropped (drop_snat_no_route)", compatSrcMax)

// The fallbacks of the features the agent itself uses.
const (
	cmpXchgWithout         = "a new flow takes over an expired conntrack entry with a plain store (the programs' compare-and-exchange rewritten at load): two CPUs taking over the same expired entry in the same instant both win, and the later one's flow keeps it"
	lookupAndDeleteWithout = "the conntrack sweep reads, checks and deletes each entry: a flow reopened on the same tuple between its read and its delete (microseconds) loses its fresh entries, and its next packet starts it anew"
	forEachMapElemWithout  = "the walk that marks a released backend's flows stale copies the conntrack tables to the agent (about 0.1 s of CPU per quarter-million entries) instead of running in the kernel"
	netnsCookieWithout     = "the socket hooks act on no socket (they cannot tell the node's sockets from pods'): the node's own processes reach frontends only through the stack"
)

// ForceFallbacks in Options, checked by forceFallbacks.
var errNoFallback = errors.New("feature has no fallback to force")

// forceFallbacks marks the named features absent, as if the kernel lacked
// them (Options.ForceFallbacks): their fallbacks run.
func (r *KernelReport) forceFallbacks(names []string) error {
	for _, name := range names {
		i := slices.IndexFunc(r.Features, func(f KernelFeature) bool { return f.Name == name })
		switch {
		case i < 0:
			return fmt.Errorf("force fallback of %q: no such feature in %v", name, r.LogArgs())
		case r.Features[i].Without == "":
			return fmt.Errorf("force fallback of %q: %w", name, errNoFallback)
		}
		r.Features[i].Present = false
		r.Features[i].Forced = true
	}
	return nil
}

// has says whether the kernel has the named feature; one the probe did not
// look for (no object calls the helper) counts as present.
func (r KernelReport) has(name string) bool {
	i := slices.IndexFunc(r.Features, func(f KernelFeature) bool { return f.Name == name })
	return i < 0 || r.Features[i].Present
}

// compat is what the loaded programs and the agent do on this kernel,
// derived from its report.
type compat struct {
	// knobs are bpf/compat.h's constants by name (configure sets those an
	// object has).
	knobs map[string]any
	// clock is the datapath's clock (CLOCK_MONOTONIC_COARSE, or
	// CLOCK_MONOTONIC without bpf_ktime_get_coarse_ns).
	clock int32
	// lookupAndDelete says the conntrack sweep may take entries
	// atomically (deleteCandidates).
	lookupAndDelete bool
	// netnsCookie says SO_NETNS_COOKIE reads the namespace's cookie.
	netnsCookie bool
	// cmpXchg says the kernel has BPF's compare-and-exchange; without it
	// configure rewrites it (withoutCmpXchg).
	cmpXchg bool
	// forEachMapElem says the stale walk runs in the kernel
	// (markReleasedInKernel), else in the agent (markReleasedInUser).
	forEachMapElem bool
}

// newCompat derives the fallbacks from r. srcs are the interfaces' source
// addresses and MTUs for the programs without BPF_FIB_LOOKUP_SRC or
// bpf_check_mtu (sourceAddrs).
func newCompat(r KernelReport, srcs []ifaceAddr) compat {
	c := compat{
		knobs:           map[string]any{},
		clock:           unix.CLOCK_MONOTONIC_COARSE,
		lookupAndDelete: r.has(featureLookupAndDelete),
		netnsCookie:     r.has(featureNetnsCookie),
		cmpXchg:         r.has(featureCmpXchg),
		forEachMapElem:  r.has(featureForEachMapElem),
	}
	flag := func(b bool) uint8 {
		if b {
			return 1
		}
		return 0
	}
	for fn, h := range newHelpers {
		c.knobs[h.knob] = flag(!r.has("helper " + helperName(fn)))
	}
	if !r.has("helper " + helperName(asm.FnKtimeGetCoarseNs)) {
		c.clock = unix.CLOCK_MONOTONIC
	}
	c.knobs[tcVarCfgNoFibSrc] = flag(!r.has(featureFIBLookupSrc))
	var idx, mtu [compatSrcMax]uint32
	var addr [compatSrcMax][4]byte
	var addr6 [compatSrcMax][16]byte
	for i, s := range srcs {
		if i == compatSrcMax {
			break
		}
		idx[i], mtu[i] = s.ifindex, s.mtu
		if s.addr.IsValid() {
			addr[i] = s.addr.As4()
		}
		if s.addr6.IsValid() {
			addr6[i] = s.addr6.As16()
		}
	}
	c.knobs[tcVarCfgSrcAddr6] = addr6
	c.knobs[tcVarCfgSrcIfindex], c.knobs[tcVarCfgSrcAddr], c.knobs[tcVarCfgSrcMtu] = idx, addr, mtu
	return c
}

// now reads the datapath's clock in ns.
func (c compat) now() (uint64, error) {
	var ts unix.Timespec
	if err := unix.ClockGettime(c.clock, &ts); err != nil {
		return 0, fmt.Errorf("read the datapath's clock %d: %w", c.clock, err)
	}
	return uint64(ts.Nano()), nil
}

// ifaceAddr is an interface's source addresses (sourceAddrs) and its
// MTU.
type ifaceAddr struct {
	ifindex uint32
	// addr is its IPv4 source address, addr6 its IPv6 one; the zero Addr
	// where it has none of the family.
	addr, addr6 netip.Addr
	mtu         uint32
}

// String is how the agent's log shows it.
func (a ifaceAddr) String() string {
	show := func(ip netip.Addr) string {
		if !ip.IsValid() {
			return "none"
		}
		return ip.String()
	}
	return fmt.Sprintf("%d: %s %s mtu %d", a.ifindex, show(a.addr), show(a.addr6), a.mtu)
}

// sourceAddrs lists the interfaces of the calling thread's network
// namespace that have a global address of either family, by ifindex, with
// their source addresses and MTU: the source addresses of flows
// source-NATed out of each without BPF_FIB_LOOKUP_SRC, and the MTUs
// without bpf_check_mtu. An interface's addresses are:
//   - IPv4: its primary (first, not secondary) address of scope global;
//   - IPv6: the address the kernel would choose as the source towards a
//     global destination (RFC 6724 as Linux applies it), of those the
//     dump lists: of scope global (not link-local, not loopback), not
//     tentative (duplicate address detection still running, unless
//     optimistic) and not failed; of these, one that is preferred (not
//     deprecated, not optimistic) before one that is not, one outside
//     fc00::/7 (the label of a global destination in the default policy
//     table) before a unique local one, a public one before a temporary
//     one (privacy extensions: the kernel's default with use_tempaddr
//     below 2); ties go to the first in the dump, the kernel's own order
//     (newest first), as they do in the kernel. What depends on the
//     destination (a matching label, the longest matching prefix) is not
//     known here.
func sourceAddrs() ([]ifaceAddr, error) {
	addrs, err := netlink.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return nil, fmt.Errorf("list addresses: %w", err)
	}
	byIndex := map[int]*ifaceAddr{}
	rank6 := map[int]int{}
	for _, a := range addrs {
		ip, ok := netip.AddrFromSlice(a.IP)
		if !ok || a.Scope != unix.RT_SCOPE_UNIVERSE {
			continue
		}
		ip = ip.Unmap()
		rank := 0
		if ip.Is4() {
			if a.Flags&unix.IFA_F_SECONDARY != 0 {
				continue
			}
		} else if rank = sourceRank6(ip, a.Flags); rank < 0 {
			continue
		}
		s := byIndex[a.LinkIndex]
		if s == nil {
			link, err := netlink.LinkByIndex(a.LinkIndex)
			if err != nil {
				return nil, fmt.Errorf("read interface %d: %w", a.LinkIndex, err)
			}
			s = &ifaceAddr{ifindex: uint32(a.LinkIndex), mtu: uint32(link.Attrs().MTU)}
			byIndex[a.LinkIndex] = s
		}
		switch {
		case ip.Is4():
			if !s.addr.IsValid() {
				s.addr = ip
			}
		case !s.addr6.IsValid() || rank < rank6[a.LinkIndex]:
			s.addr6, rank6[a.LinkIndex] = ip, rank
		}
	}
	out := make([]ifaceAddr, 0, len(byIndex))
	for _, s := range byIndex {
		out = append(out, *s)
	}
	slices.SortFunc(out, func(a, b ifaceAddr) int { return int(a.ifindex) - int(b.ifindex) })
	return out, nil
}

// ula is fc00::/7, unique local addresses (RFC 4193).
var ula = netip.MustParsePrefix("fc00::/7")

// sourceRank6 ranks a global IPv6 address with flags (IFA_F_*) as a
// source towards a global destination (sourceAddrs): lower is
// preferred, -1 is never chosen.
func sourceRank6(ip netip.Addr, flags int) int {
	switch {
	case flags&unix.IFA_F_DADFAILED != 0,
		flags&unix.IFA_F_TENTATIVE != 0 && flags&unix.IFA_F_OPTIMISTIC == 0:
		return -1
	}
	rank := 0
	if flags&(unix.IFA_F_DEPRECATED|unix.IFA_F_OPTIMISTIC) != 0 {
		rank += 4
	}
	if ula.Contains(ip) {
		rank += 2
	}
	if flags&unix.IFA_F_TEMPORARY != 0 {
		rank++
	}
	return rank
}

// errnoENOTSUPP is the kernel's internal ENOTSUPP (include/linux/errno.h),
// which the bpf syscall leaks for operations a map type lacks.
const errnoENOTSUPP = unix.Errno(524)

// probeLookupAndDelete says whether the kernel takes an entry out of a
// hash map atomically (BPF_MAP_LOOKUP_AND_DELETE_ELEM on hash maps, Linux
// 5.14; before, only queues and stacks).
func probeLookupAndDelete() (bool, error) {
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		return false, fmt.Errorf("probe lookup-and-delete: create map: %w", err)
	}
	defer m.Close()
	if err := m.Put(uint32(1), uint32(2)); err != nil {
		return false, fmt.Errorf("probe lookup-and-delete: %w", err)
	}
	var v uint32
	err = m.LookupAndDelete(uint32(1), &v)
	switch {
	case err == nil && v == 2:
		return true, nil
	case err == nil:
		return false, fmt.Errorf("probe lookup-and-delete: took value %d, want 2", v)
	case errors.Is(err, ebpf.ErrNotSupported), errors.Is(err, errnoENOTSUPP), errors.Is(err, unix.EINVAL):
		return false, nil
	}
	return false, fmt.Errorf("probe lookup-and-delete: %w", err)
}

// probeForEachMapElem says whether tc programs may call
// bpf_for_each_map_elem (Linux 5.13), as ct_mark_stale does.
func probeForEachMapElem() (bool, error) {
	err := features.HaveProgramHelper(ebpf.SchedCLS, asm.FnForEachMapElem)
	if err != nil && !errors.Is(err, ebpf.ErrNotSupported) {
		return false, fmt.Errorf("probe helper bpf_for_each_map_elem: %w", err)
	}
	return err == nil, nil
}

// probeNetnsCookie says whether SO_NETNS_COOKIE reads a network
// namespace's cookie (Linux 5.14).
func probeNetnsCookie() (bool, error) {
	_, err := netnsCookie()
	if errors.Is(err, unix.ENOPROTOOPT) {
		return false, nil
	}
	return err == nil, err
}

// datapathClock is the clock bpf/compat.h's compat_now reads on this
// kernel: CLOCK_MONOTONIC_COARSE where bpf_ktime_get_coarse_ns exists, else
// CLOCK_MONOTONIC.
func datapathClock() (int32, error) {
	err := features.HaveProgramHelper(ebpf.SchedCLS, asm.FnKtimeGetCoarseNs)
	switch {
	case err == nil:
		return unix.CLOCK_MONOTONIC_COARSE, nil
	case errors.Is(err, ebpf.ErrNotSupported):
		return unix.CLOCK_MONOTONIC, nil
	}
	return 0, fmt.Errorf("probe helper bpf_ktime_get_coarse_ns: %w", err)
}

// probeCmpXchg says whether the verifier takes BPF_CMPXCHG (Linux 5.12;
// before, only BPF_XADD, and Linux 5.10 rejects any other atomic
// instruction before it looks at what is reachable, so no load-time knob
// can hide one). Like ct_claim_expired in snat_claim, it exchanges a map
// value's 64 bits in a BPF-to-BPF function.
func probeCmpXchg() (bool, error) {
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		return false, fmt.Errorf("probe BPF_CMPXCHG: create map: %w", err)
	}
	defer m.Close()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.SchedCLS, License: "GPL", Instructions: asm.Instructions{
		asm.Call.Label("claim"),
		asm.Return(),
		asm.StoreImm(asm.RFP, -4, 0, asm.Word).WithSymbol("claim"),
		asm.LoadMapPtr(asm.R1, m.FD()),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, -4),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "out"),
		asm.Mov.Reg(asm.R1, asm.R0),
		asm.Mov.Imm(asm.R0, 0),
		asm.Mov.Imm(asm.R2, 1),
		cmpXchgInsn(asm.R1, asm.R2, asm.DWord, 0),
		asm.Mov.Imm(asm.R0, 0).WithSymbol("out"),
		asm.Return(),
	}})
	if errors.Is(err, unix.EINVAL) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("probe BPF_CMPXCHG: %w", err)
	}
	prog.Close()
	return true, nil
}

// cmpXchgInsn is r0 = cmpxchg(dst + off, r0, src). cilium/ebpf (v0.22)
// writes an atomic instruction's immediate, which names the operation,
// from its Constant, not from the operation in its OpCode (as an object's
// instruction carries both): asm.CmpXchg.Mem alone goes to the kernel as
// BPF_XADD, which every kernel takes (TestCmpXchgInsn).
func cmpXchgInsn(dst, src asm.Register, size asm.Size, off int16) asm.Instruction {
	ins := asm.CmpXchg.Mem(dst, src, size, off)
	ins.Constant = int64(asm.CmpXchg >> 8)
	return ins
}

// withoutCmpXchg rewrites each compare-and-exchange of spec's programs,
// r0 = cmpxchg(dst + off, r0, src), into the plain store
// *(dst + off) = src: r0 keeps the value expected, so the caller sees the
// exchange succeed. The C side's one use, ct_claim_expired (bpf/ct.h),
// then claims an expired entry unconditionally (cmpXchgWithout).
func withoutCmpXchg(spec *ebpf.CollectionSpec) error {
	for name, p := range spec.Programs {
		for i, ins := range p.Instructions {
			switch op := ins.OpCode.AtomicOp(); op {
			case asm.InvalidAtomic, asm.AddAtomic:
				continue
			case asm.CmpXchg:
				p.Instructions[i].OpCode = asm.StoreMemOp(ins.OpCode.Size())
				p.Instructions[i].Constant = 0
			default:
				return fmt.Errorf("program %s: instruction %d: atomic %s has no rewrite for kernels without BPF atomics", name, i, op)
			}
		}
	}
	return nil
}
