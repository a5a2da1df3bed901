package maps

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/topolb/topolb/internal/nettest"
)

// forceFallbacksEnv, when set, makes newDatapath force the fallbacks of
// every feature fallbackFeatures names: TestFallbacks runs tests so.
const forceFallbacksEnv = "TOPOLB_TEST_FORCE_FALLBACKS"

// fallbackFeatures names the features the running kernel has whose
// fallback the datapath can take instead, but SO_NETNS_COOKIE: without it
// the socket hooks act on no socket, which TestForceFallbacks checks
// alone (the tests of the hooks would only skip).
func fallbackFeatures(t testing.TB) []string {
	t.Helper()
	var names []string
	for _, f := range probeKernel(t).Features {
		if f.Present && f.Without != "" && f.Name != featureNetnsCookie {
			names = append(names, f.Name)
		}
	}
	return names
}

// TestForceFallbacks loads the programs with every fallback forced: the
// verifier accepts them, and each object holds the knobs the report
// implies. Forcing what has no fallback, or no feature, fails Load.
func TestForceFallbacks(t *testing.T) {
	requirePrivileges(t)
	force := append(fallbackFeatures(t), featureNetnsCookie)
	d := newDatapath(t, Options{ForceFallbacks: force})
	for _, name := range force {
		i := slices.IndexFunc(d.kernel.Features, func(f KernelFeature) bool { return f.Name == name })
		if f := d.kernel.Features[i]; f.Present || !f.Forced {
			t.Errorf("%s: present %v, forced %v after forcing it", name, f.Present, f.Forced)
		}
	}
	want := map[string]uint8{}
	for fn, h := range newHelpers {
		if !d.kernel.has("helper " + helperName(fn)) {
			want[h.knob] = 1
		}
	}
	if !d.kernel.has(featureFIBLookupSrc) {
		want[tcVarCfgNoFibSrc] = 1
	}
	if len(want) == 0 {
		t.Fatalf("no fallback forced: %v", d.kernel.LogArgs())
	}
	for obj, coll := range map[string]*ebpf.Collection{"tc": d.tcColl, "xdp": d.xdpColl, "uplink": d.uplinkColl, "sock": d.sockColl} {
		for _, knob := range []string{tcVarCfgNoCoarseClock, tcVarCfgNoCheckMtu, tcVarCfgNoXdpStoreBytes, tcVarCfgNoSetRetval, tcVarCfgNoFibSrc} {
			v, ok := coll.Variables[knob]
			if !ok {
				continue
			}
			var got uint8
			if err := v.Get(&got); err != nil {
				t.Fatalf("%s: read %s: %v", obj, knob, err)
			}
			if got != want[knob] {
				t.Errorf("%s: %s = %d, want %d", obj, knob, got, want[knob])
			}
		}
	}
	var cookie uint64
	if err := d.sockColl.Variables[sockNetnsCookieVar].Get(&cookie); err != nil {
		t.Fatal(err)
	}
	if cookie != 0 {
		t.Errorf("socket hooks without SO_NETNS_COOKIE act on namespace %d, want none (0)", cookie)
	}
	if d.compat.lookupAndDelete || d.compat.clock != unix.CLOCK_MONOTONIC {
		t.Errorf("agent side: atomic sweep %v, clock %d; want false, CLOCK_MONOTONIC", d.compat.lookupAndDelete, d.compat.clock)
	}

	for _, c := range []struct{ name, force string }{
		{"no_fallback", "helper bpf_map_lookup_elem"},
		{"no_feature", "warp drive"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := Load(Options{PinPath: filepath.Join(bpffs(t), "topolb"), ForceFallbacks: []string{c.force}})
			if err == nil || !strings.Contains(err.Error(), c.force) {
				t.Errorf("Load forcing %q: %v, want an error naming it", c.force, err)
			}
			if c.name == "no_fallback" && !errors.Is(err, errNoFallback) {
				t.Errorf("error %v does not wrap errNoFallback", err)
			}
		})
	}
}

// TestFallbackClock: the datapath's clock, as a new flow's expiry shows
// it, is CLOCK_MONOTONIC_COARSE, and CLOCK_MONOTONIC with the fallback for
// bpf_ktime_get_coarse_ns (its value lies between two readings of the
// clock around the packet; the other clock lags by up to a tick).
func TestFallbackClock(t *testing.T) {
	requirePrivileges(t)
	coarse := "helper " + helperName(asm.FnKtimeGetCoarseNs)
	for _, c := range []struct {
		name  string
		force []string
		clock int32
	}{
		{"coarse", []string{}, unix.CLOCK_MONOTONIC_COARSE},
		{"fallback", []string{coarse}, unix.CLOCK_MONOTONIC},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := newDatapath(t, Options{ForceFallbacks: c.force})
			if c.clock == unix.CLOCK_MONOTONIC_COARSE && !d.kernel.has(coarse) {
				t.Skipf("kernel %s lacks %s", d.kernel.Release, coarse)
			}
			if d.compat.clock != c.clock {
				t.Fatalf("agent's clock %d, want %d", d.compat.clock, c.clock)
			}
			mustSet(t, d, fe(vipUDP, UDP), be(beUDP))
			before, err := d.compat.now()
			if err != nil {
				t.Fatal(err)
			}
			if ret, _ := run(t, d.tcProg, udpFrame(client, vipUDP, "q").bytes()); ret != tcOK {
				t.Fatalf("verdict %d", ret)
			}
			after, err := d.compat.now()
			if err != nil {
				t.Fatal(err)
			}
			at := readCT(t, d, ctKey(client, vipUDP, protoUDP)).Expires - uint64(TimeoutUDP)
			if at < before || at > after {
				t.Errorf("flow created at %d, not between the clock's %d and %d (%s before, %s after)",
					at, before, after, time.Duration(before-min(at, before)), time.Duration(max(at, after)-after))
			}
		})
	}
}

// fallbackTests are the tests TestFallbacks runs with every fallback
// forced, by what they cover: the clock (conntrack and fragment expiry),
// MTU checks by FIB lookup (forwarding), XDP replies written byte by byte
// (rejects), socket hooks refusing with EPERM (real rejects), source NAT
// addresses from the agent (north-south: XDP's and tc's, both families, in
// tables and with real traffic), the read-check-delete sweep, and the
// stale walk in user space (released backends' flows).
var fallbackTests = []string{
	"TestConntrackLifecycle", "TestFragmentTimeout",
	"TestXDPNorthSouth", "TestXDPNorthSouth6", "TestTCForwarding", "TestSNATHandoffBeyondMTU",
	"TestTCUplinkNorthSouth6", "TestUplinkDeliversIPv6",
	"TestRejects", "TestRejectRealTraffic",
	"TestSweepConntrack", "TestSweepDeletesOrphans", "TestSweepTakesStaleFlowsWhole",
	"TestBackendStates", "TestConntrackFollowsBackendState", "TestMarkReleasedPaths",
}

// TestFallbacks runs fallbackTests again in a child process with every
// fallback forced (forceFallbacksEnv), so each fallback branch runs on
// this kernel, through the same checks as the modern path. Each must pass,
// not skip.
func TestFallbacks(t *testing.T) {
	requirePrivileges(t)
	if os.Getenv(forceFallbacksEnv) != "" {
		t.Skip("already the child")
	}
	if len(fallbackFeatures(t)) == 0 {
		t.Skip("the kernel has none of the features with a fallback")
	}
	cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.v", "-test.count=1",
		"-test.run", "^("+strings.Join(fallbackTests, "|")+")$")
	cmd.Env = append(os.Environ(), forceFallbacksEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Errorf("tests with every fallback forced: %v\n%s", err, out)
	}
	for _, name := range fallbackTests {
		if !regexp.MustCompile(`(?m)^--- PASS: ` + name + ` `).Match(out) {
			t.Errorf("%s did not pass with every fallback forced", name)
		}
	}
	if t.Failed() {
		return
	}
	t.Logf("with %v forced: %d tests passed", fallbackFeatures(t), len(fallbackTests))
}

// TestWithoutCmpXchg: the rewrite for kernels without BPF atomics leaves
// no compare-and-exchange in any object, each one a store to the same
// place (the verifier takes the result: TestForceFallbacks).
func TestWithoutCmpXchg(t *testing.T) {
	for name, load := range map[string]func() (*ebpf.CollectionSpec, error){"tc": loadTc, "xdp": loadXdp, "uplink": loadUplink, "sock": loadSock} {
		spec, err := load()
		if err != nil {
			t.Fatal(err)
		}
		type place struct {
			prog string
			i    int
		}
		var cas []place
		for pn, p := range spec.Programs {
			for i, ins := range p.Instructions {
				if ins.OpCode.AtomicOp() == asm.CmpXchg {
					cas = append(cas, place{pn, i})
				}
			}
		}
		if err := withoutCmpXchg(spec); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		for pn, p := range spec.Programs {
			for i, ins := range p.Instructions {
				if ins.OpCode.AtomicOp() == asm.CmpXchg {
					t.Errorf("%s: %s: instruction %d still %v", name, pn, i, ins)
				}
			}
		}
		for _, c := range cas {
			ins := spec.Programs[c.prog].Instructions[c.i]
			if ins.OpCode != asm.StoreMemOp(asm.DWord) {
				t.Errorf("%s: %s: instruction %d is %v, want a 64-bit store", name, c.prog, c.i, ins)
			}
		}
		t.Logf("%s: %d compare-and-exchanges rewritten", name, len(cas))
	}
}

// TestLookupRecords: the backend records read one lookup per id (kernels
// without batch lookups on per-CPU arrays) are the batch's.
func TestLookupRecords(t *testing.T) {
	requirePrivileges(t)
	d := newDatapath(t, Options{})
	mustSet(t, d, fe(vipUDP, UDP), be(beUDP), be("10.1.1.4:5353"))
	upto, ok := d.maxMemberID()
	if !ok {
		t.Fatal("no member ids")
	}
	per := make([]tcBackendStats, d.ncpu)
	per[0].Packets, per[d.ncpu-1].Bytes = 7, 9
	if err := d.backendStats.Update(upto, per, ebpf.UpdateExist); err != nil {
		t.Fatal(err)
	}
	batch, err := d.kernelMaps().readRecords(upto)
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skipf("kernel %s has no batch lookups on per-CPU arrays", d.kernel.Release)
	}
	if err != nil {
		t.Fatal(err)
	}
	one, err := d.kernelMaps().lookupRecords(upto)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(batch, one) || len(one) != int(upto)+1 || one[upto].traffic.Packets != 7 || one[upto].traffic.Bytes != 9 {
		t.Errorf("lookups read %v, the batch %v; want the same, ids 0..%d, the last with 7 packets and 9 bytes", one, batch, upto)
	}
}

// TestCmpXchgInsn: the probe's compare-and-exchange goes to the kernel as
// one, as the objects' do (an instruction that says add would make the
// probe find it on every kernel), and withoutCmpXchg recognises it.
func TestCmpXchgInsn(t *testing.T) {
	wire := func(ins asm.Instruction) []byte {
		t.Helper()
		var b bytes.Buffer
		if _, err := ins.Marshal(&b, binary.LittleEndian); err != nil {
			t.Fatal(err)
		}
		return b.Bytes()
	}
	got := wire(cmpXchgInsn(asm.R1, asm.R2, asm.DWord, 0))
	// BPF_STX|BPF_ATOMIC|BPF_DW, dst r1, src r2, off 0, imm BPF_CMPXCHG.
	want := []byte{0xdb, 0x21, 0, 0, 0xf1, 0, 0, 0}
	if !bytes.Equal(got, want) {
		t.Errorf("cmpXchgInsn marshals as % x, want % x", got, want)
	}
	var back asm.Instruction
	if err := back.Unmarshal(bytes.NewReader(got), binary.LittleEndian, "linux"); err != nil {
		t.Fatal(err)
	}
	if op := back.OpCode.AtomicOp(); op != asm.CmpXchg {
		t.Errorf("cmpXchgInsn reads back as %v", op)
	}
}

// verifierStats is the verifier's summary line (ebpf.LogLevelStats).
var verifierStats = regexp.MustCompile(`processed \d+ insns.*`)

// TestVerifierEveryConfig loads the programs of the balancing objects as
// Load configures them on this kernel, and again with every fallback
// forced, each with no interface and with the full table of compatSrcMax
// for the fallbacks of BPF_FIB_LOOKUP_SRC and bpf_check_mtu (the node's
// interfaces): the knobs change what the verifier walks. Inlined,
// compat_iface gave each interface of the table a path of its own through
// xdp_lb, and Linux 5.10 stopped at its 1,000,000 instructions with 4
// (bpf/compat.h). It logs how many instructions each program took.
func TestVerifierEveryConfig(t *testing.T) {
	requirePrivileges(t)
	opts, err := Options{PinPath: "/unused"}.withDefaults()
	must(t, err)
	tcSpec, err := loadTc()
	must(t, err)
	kernel, err := probeDatapathKernel(tcSpec)
	must(t, err)
	reports := map[string]KernelReport{"kernel": kernel}
	if force := fallbackFeatures(t); len(force) > 0 {
		forced := KernelReport{Release: kernel.Release, Features: slices.Clone(kernel.Features)}
		must(t, forced.forceFallbacks(force))
		reports["forced"] = forced
	}
	full := make([]ifaceAddr, compatSrcMax)
	for i := range full {
		full[i] = ifaceAddr{ifindex: uint32(i + 1), addr: netip.AddrFrom4([4]byte{10, 0, 0, byte(i + 1)}),
			addr6: netip.AddrFrom16([16]byte{0: 0xfd, 15: byte(i + 1)}), mtu: 1500}
	}
	objects := map[string]func() (*ebpf.CollectionSpec, error){"tc": loadTc, "xdp": loadXdp, "uplink": loadUplink}
	for rname, r := range reports {
		for _, srcs := range [][]ifaceAddr{nil, full} {
			c := newCompat(r, srcs)
			for oname, load := range objects {
				name := fmt.Sprintf("%s/%d interfaces/%s", rname, len(srcs), oname)
				spec, err := load()
				must(t, err)
				sizeMaps(spec, opts)
				if err := configure(spec, opts, c, 0, 0); err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{Programs: ebpf.ProgramOptions{LogLevel: ebpf.LogLevelStats}})
				if err != nil {
					// The verifier's whole log: its last lines say why it
					// refused the program.
					var ve *ebpf.VerifierError
					if errors.As(err, &ve) {
						t.Errorf("%s: %v\n%+v", name, err, ve)
					} else {
						t.Errorf("%s: %v", name, err)
					}
					continue
				}
				for pname, p := range coll.Programs {
					t.Logf("%s %s: %s", name, pname, verifierStats.FindString(p.VerifierLog))
				}
				coll.Close()
			}
		}
	}
}

// TestSourceAddrs: the interfaces' source addresses for the fallback of
// BPF_FIB_LOOKUP_SRC, read by netlink in a namespace of the test's own.
// a0 has a link-local address, two global ones, and, added after them
// (so listed before them: the kernel lists an interface's newest address
// first), a unique local one, a deprecated one and a tentative one, and
// two IPv4 addresses (the second secondary). Its IPv6 source is one of the
// two global addresses, the one the kernel itself chooses towards a global
// destination through a0; its IPv4 source is the primary. a1 has an IPv6
// address only, lo none that is global: a1 is listed with no IPv4 source,
// lo not at all.
func TestSourceAddrs(t *testing.T) {
	requirePrivileges(t)
	ns, peer := nettest.NewNS(t, "srcaddr"), nettest.NewNS(t, "srcaddr-peer")
	must(t, nettest.Veth(ns, "a0", peer, "p0"))
	must(t, nettest.Veth(ns, "a1", peer, "p1"))
	must(t, ns.SetMTU("a1", 1400))
	// Duplicate address detection holds a new address tentative for
	// dad_transmits seconds (retrans_time 1 s).
	must(t, ns.Sysctl("net.ipv6.conf.a0.dad_transmits", "100"))
	nl := ns.Netlink()
	a0, err := nl.LinkByName("a0")
	must(t, err)
	a1, err := nl.LinkByName("a1")
	must(t, err)
	add := func(link netlink.Link, prefix string, flags, preferred int) {
		t.Helper()
		a, err := netlink.ParseAddr(prefix)
		must(t, err)
		a.Flags = flags
		if preferred >= 0 {
			a.PreferedLft, a.ValidLft = preferred, 3600
		}
		if err := nl.AddrAdd(link, a); err != nil {
			t.Fatalf("add %s to %s: %v", prefix, link.Attrs().Name, err)
		}
	}
	add(a0, "fe80::5/64", unix.IFA_F_NODAD, -1)
	add(a0, "2001:db8:1::5/64", unix.IFA_F_NODAD, -1)
	add(a0, "2001:db8:1::6/64", unix.IFA_F_NODAD, -1)
	add(a0, "fd00:1::5/64", unix.IFA_F_NODAD, -1)
	add(a0, "2001:db8:1::7/64", unix.IFA_F_NODAD, 0) // preferred lifetime 0: deprecated
	add(a0, "2001:db8:1::8/64", 0, -1)               // tentative for 100 s
	add(a0, "192.0.2.5/24", 0, -1)
	add(a0, "192.0.2.6/24", 0, -1) // secondary
	add(a1, "2001:db8:9::1/64", unix.IFA_F_NODAD, -1)

	// The test's premises, as the kernel reports them.
	flags := map[string]int{}
	list, err := nl.AddrList(a0, netlink.FAMILY_V6)
	must(t, err)
	for _, a := range list {
		flags[a.IP.String()] = a.Flags
	}
	for ip, want := range map[string]int{"2001:db8:1::7": unix.IFA_F_DEPRECATED, "2001:db8:1::8": unix.IFA_F_TENTATIVE} {
		if flags[ip]&want == 0 {
			t.Fatalf("%s has flags %#x, want %#x among them", ip, flags[ip], want)
		}
	}
	must(t, ns.AddRouteDev("2001:db8:ff::/64", "a0", ""))
	routes, err := nl.RouteGet(net.ParseIP("2001:db8:ff::1"))
	must(t, err)
	if len(routes) != 1 {
		t.Fatalf("route to 2001:db8:ff::1: %v", routes)
	}
	kernels, ok := netip.AddrFromSlice(routes[0].Src)
	if !ok || (kernels.String() != "2001:db8:1::5" && kernels.String() != "2001:db8:1::6") {
		t.Fatalf("the kernel's source towards 2001:db8:ff::1 is %v, want one of the two global addresses", routes[0].Src)
	}

	var got []ifaceAddr
	must(t, ns.Do(func() error {
		got, err = sourceAddrs()
		return err
	}))
	want := []ifaceAddr{
		{ifindex: uint32(a0.Attrs().Index), addr: netip.MustParseAddr("192.0.2.5"), addr6: kernels, mtu: 1500},
		{ifindex: uint32(a1.Attrs().Index), addr6: netip.MustParseAddr("2001:db8:9::1"), mtu: 1400},
	}
	slices.SortFunc(want, func(a, b ifaceAddr) int { return int(a.ifindex) - int(b.ifindex) })
	if !slices.Equal(got, want) {
		t.Errorf("source addresses %v, want %v", got, want)
	}
}

// TestSourceRank6 ranks IPv6 sources as sourceAddrs does, by the flags
// and ranges netlink cannot all give a test (an optimistic address needs
// optimistic_dad, a temporary one router advertisements).
func TestSourceRank6(t *testing.T) {
	global, ulaAddr := netip.MustParseAddr("2001:db8::1"), netip.MustParseAddr("fd00::1")
	for _, c := range []struct {
		name  string
		ip    netip.Addr
		flags int
		want  int
	}{
		{"global", global, unix.IFA_F_PERMANENT, 0},
		{"temporary", global, unix.IFA_F_TEMPORARY, 1},
		{"unique_local", ulaAddr, 0, 2},
		{"deprecated", global, unix.IFA_F_DEPRECATED, 4},
		{"optimistic", global, unix.IFA_F_TENTATIVE | unix.IFA_F_OPTIMISTIC, 4},
		{"deprecated_temporary_unique_local", ulaAddr, unix.IFA_F_DEPRECATED | unix.IFA_F_TEMPORARY, 7},
		{"tentative", global, unix.IFA_F_TENTATIVE, -1},
		{"dad_failed", global, unix.IFA_F_DADFAILED | unix.IFA_F_TENTATIVE, -1},
	} {
		if got := sourceRank6(c.ip, c.flags); got != c.want {
			t.Errorf("%s: rank %d, want %d", c.name, got, c.want)
		}
	}
}
