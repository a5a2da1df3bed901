package maps

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/topolb/topolb/internal/nettest"
	"github.com/topolb/topolb/internal/portrange"
)

// The forwarding tables run the programs with BPF_PROG_TEST_RUN inside a
// node namespace whose FIB, neighbour table and interfaces they resolve
// against, the packet arriving on a named interface (the test run's
// ingress_ifindex / ifindex), and check verdicts, output bytes (MACs, TTL,
// checksums), XDP metadata, conntrack entries and counters:
//
//	pod1 10.244.1.10 ── hp1 ┐                     ┌ up0 10.250.0.1/24 ─ node2 .2 (10.244.2.0/24), node3 .3 (10.244.3.0/24, no neighbour),
//	pod2 10.244.1.11 ── hp2 ┤ node (ip_forward)   │                     node5 .5 (10.244.6.0/24, no neighbour), router .254 (203.0.113.0/24)
//	client 10.244.1.20 ─ hc ┘                     ├ up1 10.251.0.1/24, MTU 1400 ─ node4 .2 (10.244.4.0/24, 198.18.0.0/24)
//	                                              └ other0 10.252.0.1/24 (10.244.5.0/24 on link): an interface topolb is not attached to
//
// pod2 has no neighbour entry (its MAC is unknown to the node).

// Verdicts the forwarding rows expect.
const (
	tcRedirect  = 7 // TC_ACT_REDIRECT
	xdpTX       = 3 // XDP_TX
	xdpRedirect = 4 // XDP_REDIRECT
)

var (
	macNode2  = [6]byte{0x02, 0, 0, 0, 0x02, 0x02}
	macNode3  = [6]byte{0x02, 0, 0, 0, 0x03, 0x03}
	macNode4  = [6]byte{0x02, 0, 0, 0, 0x04, 0x04}
	macRouter = [6]byte{0x02, 0, 0, 0, 0xfe, 0xfe}
	macPod1b  = [6]byte{0x02, 0, 0, 0, 0x01, 0xbb} // pod1's MAC after "pod1 was re-created"
)

// Addresses of the forwarding namespace.
const (
	nodeAddr   = "10.250.0.1"
	pod1       = "10.244.1.10"
	pod2       = "10.244.1.11"
	podClient  = "10.244.1.20"
	beNode2    = "10.244.2.10"
	beNode3    = "10.244.3.10"
	beNode4    = "10.244.4.10"
	beOther    = "10.244.5.10"
	beNode5    = "10.244.6.10"
	outside    = "203.0.113.10"
	outsideUp1 = "198.18.0.5"
	otherAddr  = "10.252.0.1"
)

// fwdEnv is the node namespace of the forwarding tables with its datapath.
type fwdEnv struct {
	node *nettest.NS
	// wire is the other end of the uplinks (w0, w1) and of other0 (w2).
	wire *nettest.NS
	d    *Datapath
	idx  map[string]int
	mac  map[string][6]byte
}

// newFwdEnv builds the forwarding namespace of the picture above, IPv4
// only, and loads and attaches a datapath in it.
func newFwdEnv(t *testing.T, opts Options) *fwdEnv { return newFwdEnvFamilies(t, opts, false) }

// newFwdEnvFamilies is newFwdEnv with, when ipv6 is set, the IPv6 half
// (addIPv6) configured before the datapath loads: the agent reads the
// interfaces' addresses at load (sourceAddrs, for the fallback of
// BPF_FIB_LOOKUP_SRC).
func newFwdEnvFamilies(t *testing.T, opts Options, ipv6 bool) *fwdEnv {
	t.Helper()
	requirePrivileges(t)
	requireTestRunContexts(t)
	if err := nettest.RemoveStale(); err != nil {
		t.Logf("removing stale namespaces: %v", err)
	}
	node := nettest.NewNS(t, "fwd-node")
	wire := nettest.NewNS(t, "fwd-wire")
	pods := map[string]*nettest.NS{"hp1": nettest.NewNS(t, "fwd-pod1"), "hp2": nettest.NewNS(t, "fwd-pod2"), "hc": nettest.NewNS(t, "fwd-client")}
	must(t, node.Sysctl("net.ipv4.ip_forward", "1"))
	must(t, nettest.Veth(node, "up0", wire, "w0"))
	must(t, nettest.Veth(node, "up1", wire, "w1"))
	must(t, node.SetMTU("up1", 1400))
	must(t, node.AddAddr("up0", nodeAddr+"/24"))
	must(t, node.AddAddr("up1", "10.251.0.1/24"))
	e := &fwdEnv{node: node, wire: wire, idx: map[string]int{}, mac: map[string][6]byte{}}
	for host, addr := range map[string]string{"hp1": pod1, "hp2": pod2, "hc": podClient} {
		must(t, nettest.Veth(node, host, pods[host], "eth0"))
		must(t, node.AddAddr(host, "10.244.1.1/32"))
		must(t, node.AddRouteDev(addr+"/32", host, ""))
		mac, err := pods[host].HardwareAddr("eth0")
		must(t, err)
		e.mac[addr] = [6]byte(mac)
	}
	nl := node.Netlink()
	must(t, nettest.Veth(node, "other0", wire, "w2"))
	must(t, node.AddAddr("other0", otherAddr+"/24"))
	for _, r := range []struct{ dst, dev, gw string }{
		{"10.244.2.0/24", "up0", "10.250.0.2"},
		{"10.244.3.0/24", "up0", "10.250.0.3"},
		{"10.244.6.0/24", "up0", "10.250.0.5"},
		{"203.0.113.0/24", "up0", "10.250.0.254"},
		{"10.244.4.0/24", "up1", "10.251.0.2"},
		{"198.18.0.0/24", "up1", "10.251.0.2"},
		{"10.244.5.0/24", "other0", ""},
	} {
		must(t, node.AddRouteDev(r.dst, r.dev, r.gw))
	}
	for _, ifname := range []string{"up0", "up1", "hp1", "hp2", "hc", "other0"} {
		l, err := nl.LinkByName(ifname)
		must(t, err)
		e.idx[ifname] = l.Attrs().Index
		e.mac[ifname] = [6]byte(l.Attrs().HardwareAddr)
	}
	e.neigh(t, "up0", "10.250.0.2", macNode2)
	e.neigh(t, "up0", "10.250.0.254", macRouter)
	e.neigh(t, "up1", "10.251.0.2", macNode4)
	e.neigh(t, "hp1", pod1, e.mac[pod1])
	e.neigh(t, "hc", podClient, e.mac[podClient])
	if ipv6 {
		e.addIPv6(t)
	}

	opts.PinPath = filepath.Join(bpffs(t), "topolb")
	opts.NetNS = node.Path
	e.d = newDatapath(t, opts)
	for _, p := range []string{"hp1", "hp2", "hc"} {
		must(t, e.d.AttachPod(p))
	}
	for _, u := range []string{"up0", "up1"} {
		must(t, e.d.AttachUplink(u))
	}
	return e
}

// neigh sets a permanent neighbour entry: ip (of either family) is at
// mac on ifname.
func (e *fwdEnv) neigh(t *testing.T, ifname, ip string, mac [6]byte) {
	t.Helper()
	family := netlink.FAMILY_V4
	if netip.MustParseAddr(ip).Is6() {
		family = netlink.FAMILY_V6
	}
	err := e.node.Netlink().NeighSet(&netlink.Neigh{
		LinkIndex: e.idx[ifname], Family: family, State: netlink.NUD_PERMANENT,
		IP: net.ParseIP(ip), HardwareAddr: net.HardwareAddr(mac[:]),
	})
	if err != nil {
		t.Fatalf("neighbour %s at %x on %s: %v", ip, mac, ifname, err)
	}
}

// skbCtx is the head of struct __sk_buff a tc test run accepts: up to
// ifindex (everything before it but mark and priority must be zero).
type skbCtx struct {
	Len, PktType, Mark, QueueMapping, Protocol, VlanPresent, VlanTCI, VlanProto, Priority uint32
	IngressIfindex, Ifindex                                                               uint32
}

// xdpMD is struct xdp_md, the context of an XDP test run.
type xdpMD struct {
	Data, DataEnd, DataMeta, IngressIfindex, RxQueueIndex, EgressIfindex uint32
}

// testRunContexts says which context fwdEnv.run passes that the kernel's
// BPF_PROG_TEST_RUN does not take ("" when it takes both): an xdp_md with
// an ingress interface (Linux 5.14) and a __sk_buff with ingress_ifindex
// (Linux 5.10 takes neither: EINVAL). Each is tried once with a program
// that only returns, on lo.
var testRunContexts = sync.OnceValues(func() (string, error) {
	for _, c := range []struct {
		typ  ebpf.ProgramType
		ctx  any
		what string
	}{
		{ebpf.XDP, xdpMD{DataEnd: 64, IngressIfindex: 1}, "xdp_md context with ingress_ifindex (Linux 5.14)"},
		{ebpf.SchedCLS, skbCtx{IngressIfindex: 1, Ifindex: 1}, "__sk_buff context with ingress_ifindex"},
	} {
		prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: c.typ, License: "GPL",
			Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()}})
		if err != nil {
			return "", fmt.Errorf("load a %v program: %w", c.typ, err)
		}
		_, err = prog.Run(&ebpf.RunOptions{Data: make([]byte, 64), Context: c.ctx})
		prog.Close()
		if errors.Is(err, unix.EINVAL) {
			return c.what, nil
		}
		if err != nil {
			return "", fmt.Errorf("test run of a %v program with %s: %w", c.typ, c.what, err)
		}
	}
	return "", nil
})

// requireTestRunContexts skips where BPF_PROG_TEST_RUN cannot run a frame
// as arriving on a given interface (testRunContexts), which fwdEnv.run
// needs.
func requireTestRunContexts(t *testing.T) {
	t.Helper()
	missing, err := testRunContexts()
	if err != nil {
		t.Fatal(err)
	}
	if missing != "" {
		t.Skipf("the kernel's BPF_PROG_TEST_RUN takes no %s", missing)
	}
}

// run feeds one frame through prog inside the node namespace as if it
// arrived on iif, and returns the verdict, the output frame and the XDP
// metadata in front of it.
func (e *fwdEnv) run(t *testing.T, h hook, prog *ebpf.Program, in []byte, iif string) (ret uint32, out, meta []byte) {
	t.Helper()
	idx, ok := e.idx[iif]
	if !ok {
		t.Fatalf("no interface %q", iif)
	}
	opts := &ebpf.RunOptions{Data: in, DataOut: make([]byte, len(in)+256)}
	var xdpOut xdpMD
	if h == hookXDP {
		opts.Context = xdpMD{DataEnd: uint32(len(in)), IngressIfindex: uint32(idx)}
		opts.ContextOut = &xdpOut
	} else {
		opts.Context = skbCtx{IngressIfindex: uint32(idx), Ifindex: uint32(idx)}
	}
	err := e.node.Do(func() error {
		var err error
		ret, err = prog.Run(opts)
		return err
	})
	if err != nil {
		t.Fatalf("test run: %v", err)
	}
	out = opts.DataOut
	if h == hookXDP {
		meta, out = out[:xdpOut.Data], out[xdpOut.Data:]
	}
	return ret, out, meta
}

// checkMeta compares XDP metadata with want (nil: none expected).
func checkMeta(t *testing.T, got []byte, want *tcFwdMeta) {
	t.Helper()
	if want == nil {
		if len(got) != 0 {
			t.Errorf("unexpected XDP metadata %x", got)
		}
		return
	}
	var m tcFwdMeta
	if len(got) != binary.Size(m) {
		t.Fatalf("XDP metadata %x: %d bytes, want %d", got, len(got), binary.Size(m))
	}
	if err := binary.Read(bytes.NewReader(got), binary.NativeEndian, &m); err != nil {
		t.Fatal(err)
	}
	if m != *want {
		t.Errorf("XDP metadata %+v, want %+v", m, *want)
	}
}

// handoff is the metadata XDP hands tc_uplink to deliver into a pod.
func handoff(kind tcCtRedirect, ifindex int, dmac, smac [6]byte, flags uint8) *tcFwdMeta {
	return &tcFwdMeta{Magic: uint32(tcFwdMetaConstFWD_META_MAGIC), Ifindex: uint32(ifindex), Kind: uint8(kind),
		Flags: flags, Dmac: dmac, Smac: smac}
}

// handoffNeigh is the metadata XDP hands tc_uplink to send out of ifindex
// through the neighbour subsystem, to the next hop nexthop.
func handoffNeigh(ifindex int, nexthop string, flags uint8) *tcFwdMeta {
	m := handoff(tcCtRedirectCT_REDIRECT_NEIGH, ifindex, [6]byte{}, [6]byte{}, flags)
	m.Nexthop = be32(netip.MustParseAddr(nexthop))
	return m
}

// expectEntry checks every field of a conntrack entry but its expiry
// (which must be set), its counters (runTable checks them, through
// Counters) and its sequence number (TestConntrackTCPWindow's).
func expectEntry(key tcCtKey, want tcCtValue) func(t *testing.T, d *Datapath) {
	return func(t *testing.T, d *Datapath) {
		t.Helper()
		got := readCT(t, d, key)
		if got.Expires == 0 {
			t.Errorf("entry %s -> %s: no expiry", addrPortFromWire(key.Saddr, key.Sport), addrPortFromWire(key.Daddr, key.Dport))
		}
		got.Expires, got.Packets, got.Bytes, got.TcpNext = 0, 0, 0, 0
		if got != want {
			t.Errorf("entry %s -> %s\n got %+v\nwant %+v", addrPortFromWire(key.Saddr, key.Sport), addrPortFromWire(key.Daddr, key.Dport), got, want)
		}
	}
}

// entry builds the expected value of a conntrack entry (without ids,
// generations and expiry, filled by idsOf).
type entry struct {
	dir      tcCtDir
	state    tcCtState
	addr     string // addr:port to write
	nat      string // second pair, with SNAT
	redirect tcCtRedirect
	ifindex  int
	// iif is the interface the direction's packets come in on (ct_value
	// iif): for a forward entry the first packet's, for a reply entry the
	// one its forward packets leave through; 0 unknown.
	iif         int
	smac, dmac  [6]byte
	svc         Frontend // for ids: the frontend and ...
	backendAddr string   // ... its backend
	// flags are the ct_flag bits beyond CT_F_SNAT (set by nat): reply
	// seen, assured.
	flags tcCtFlag
}

// assuredFlags are the flags of an established (promoted) flow.
const assuredFlags = tcCtFlagCT_F_REPLIED | tcCtFlagCT_F_ASSURED

func (x entry) value(t *testing.T, d *Datapath) tcCtValue {
	t.Helper()
	ap := netip.MustParseAddrPort(x.addr)
	v := tcCtValue{Addr: be32(ap.Addr()), Port: be16(ap.Port()), Dir: uint8(x.dir), State: uint8(x.state),
		Redirect: uint8(x.redirect), Ifindex: uint32(x.ifindex), Smac: x.smac, Dmac: x.dmac, Iif: uint32(x.iif)}
	v.Flags = uint8(x.flags)
	if x.nat != "" {
		n := netip.MustParseAddrPort(x.nat)
		v.Flags |= uint8(tcCtFlagCT_F_SNAT)
		v.NatAddr, v.NatPort = be32(n.Addr()), be16(n.Port())
	}
	s := d.fes[x.svc]
	if s == nil {
		t.Fatalf("frontend %s not programmed", x.svc)
	}
	m := s.members[netip.MustParseAddrPort(x.backendAddr)]
	if m == nil {
		t.Fatalf("frontend %s has no backend %s", x.svc, x.backendAddr)
	}
	v.SvcId, v.BackendId, v.BackendGen = s.id, m.id, m.gen
	return v
}

func (x entry) expect(key tcCtKey) func(t *testing.T, d *Datapath) {
	return func(t *testing.T, d *Datapath) {
		t.Helper()
		expectEntry(key, x.value(t, d))(t, d)
	}
}

func both(fs ...func(t *testing.T, d *Datapath)) func(t *testing.T, d *Datapath) {
	return func(t *testing.T, d *Datapath) {
		t.Helper()
		for _, f := range fs {
			f(t, d)
		}
	}
}

// snatFlows are the source-NATed north-south flows that xdp_lb and the
// uplinks' tc path (tc_uplink_lb) handle alike up to the verdict: to
// feCluster (pod2 here, beNode2 on node2; the client lands on beNode2),
// feRemote (beNode2, from a client behind up1) and feRemoteUDP (beNode2).
type snatFlows struct {
	feCluster, feRemote, feRemoteUDP Frontend
	cToNode2, snatSrc, cUDP, cUp1    string
	udpPort, up1Port                 uint16
}

// newSNATFlows programs the frontends of snatFlows into e's datapath.
func newSNATFlows(t *testing.T, e *fwdEnv) snatFlows {
	t.Helper()
	f := snatFlows{feCluster: extFrontend(nodeAddr+":30081", TCP), feRemote: extFrontend(nodeAddr+":30082", TCP),
		feRemoteUDP: extFrontend(nodeAddr+":30053", UDP), cUDP: ap(outside, 42000), cUp1: ap(outsideUp1, 44000)}
	mustSet(t, e.d, f.feCluster, local(ap(pod2, 8080)), be(ap(beNode2, 8080)))
	mustSet(t, e.d, f.feRemote, be(ap(beNode2, 8080)))
	mustSet(t, e.d, f.feRemoteUDP, be(ap(beNode2, 5353)))
	f.cToNode2 = srcFor(t, outside, f.feCluster, 1, 2, 41000)
	f.snatSrc = ap(nodeAddr, int(snatPortOf(netip.MustParseAddrPort(f.cToNode2), f.feCluster.Addr, protoTCP, 0, DefaultSNATPorts)))
	f.udpPort = snatPortOf(netip.MustParseAddrPort(f.cUDP), f.feRemoteUDP.Addr, protoUDP, 0, DefaultSNATPorts)
	f.up1Port = snatPortOf(netip.MustParseAddrPort(f.cUp1), f.feRemote.Addr, protoTCP, 0, DefaultSNATPorts)
	return f
}

// rows runs the flows through h's program: a new TCP flow to a remote
// backend, its reply and an established packet, a UDP query and answer,
// all leaving by up0, the uplink they came in by (verdict same), and a
// flow from behind up1 leaving by up0 (verdict other).
func (f snatFlows) rows(e *fwdEnv, h hook, same, other uint32) []pktCase {
	upMAC0 := e.mac["up0"]
	syn := tcpFrame(f.cToNode2, f.feCluster.Addr.String(), tcpSYN, "")
	reply := tcpFrame(ap(beNode2, 8080), f.snatSrc, tcpSYN|tcpACK, "")
	ack := tcpFrame(f.cToNode2, f.feCluster.Addr.String(), tcpACK, "GET / odd")
	udpQ := udpFrame(f.cUDP, f.feRemoteUDP.Addr.String(), "query")
	udpA := udpFrame(ap(beNode2, 5353), ap(nodeAddr, int(f.udpPort)), "answer!")
	up1Syn := tcpFrame(f.cUp1, f.feRemote.Addr.String(), tcpSYN, "")
	newSNAT := stats{StatConntrackCreated: 1, StatSNATFlows: 1, StatFwdL2: 2}
	return []pktCase{
		{name: "cluster_remote_backend_snat", hook: h, env: e, iif: "up0", in: syn,
			out: ptr(syn.withAddrs(f.snatSrc, ap(beNode2, 8080)).forwarded(upMAC0, macNode2)), ret: same,
			fwd: f.feCluster, newFlow: true, stats: newSNAT, after: e.snatEntries(f.feCluster, f.cToNode2, f.snatSrc)},
		{name: "cluster_remote_reply_back_to_the_client", hook: h, env: e, iif: "up0", in: reply,
			out: ptr(reply.withAddrs(f.feCluster.Addr.String(), f.cToNode2).forwarded(upMAC0, macRouter)), ret: same,
			stats: stats{StatReverseNAT: 1}},
		{name: "cluster_remote_established_hit", hook: h, env: e, iif: "up0", in: ack,
			out: ptr(ack.withAddrs(f.snatSrc, ap(beNode2, 8080)).forwarded(upMAC0, macNode2)), ret: same, fwd: f.feCluster,
			stats: stats{StatConntrackPromoted: 1}},
		{name: "udp_snat", hook: h, env: e, iif: "up0", in: udpQ,
			out: ptr(udpQ.withAddrs(ap(nodeAddr, int(f.udpPort)), ap(beNode2, 5353)).forwarded(upMAC0, macNode2)), ret: same,
			fwd: f.feRemoteUDP, newFlow: true, stats: newSNAT},
		{name: "udp_snat_reply", hook: h, env: e, iif: "up0", in: udpA,
			out: ptr(udpA.withAddrs(f.feRemoteUDP.Addr.String(), f.cUDP).forwarded(upMAC0, macRouter)), ret: same,
			stats: stats{StatReverseNAT: 1}},
		{name: "snat_to_another_uplink", hook: h, env: e, iif: "up1", in: up1Syn,
			out: ptr(up1Syn.withAddrs(ap(nodeAddr, int(f.up1Port)), ap(beNode2, 8080)).forwarded(upMAC0, macNode2)), ret: other,
			fwd: f.feRemote, newFlow: true, stats: newSNAT, after: e.up1ReplyEntry(f.feRemote, f.cUp1, ap(nodeAddr, int(f.up1Port)))},
	}
}

// etpLocalEntries expects both entries of a new flow from client to fe
// (eTP Local, on pod1), which entered by up0 from the router's side.
func (e *fwdEnv) etpLocalEntries(fe Frontend, client string) func(t *testing.T, d *Datapath) {
	return both(
		entry{dir: tcCtDirCT_FORWARD, state: tcCtStateCT_TCP_SYN_SENT, addr: ap(pod1, 8080), redirect: tcCtRedirectCT_REDIRECT_PEER,
			ifindex: e.idx["hp1"], smac: e.mac["hp1"], dmac: e.mac[pod1], iif: e.idx["up0"], svc: fe, backendAddr: ap(pod1, 8080)}.expect(ctKey(client, fe.Addr.String(), protoTCP)),
		entry{dir: tcCtDirCT_REVERSE, state: tcCtStateCT_TCP_SYN_SENT, addr: fe.Addr.String(), redirect: tcCtRedirectCT_REDIRECT_XDP,
			ifindex: e.idx["up0"], smac: e.mac["up0"], dmac: macRouter, iif: e.idx["hp1"], svc: fe, backendAddr: ap(pod1, 8080)}.expect(ctKey(ap(pod1, 8080), client, protoTCP)),
	)
}

// snatEntries expects both entries of a new flow from client to fe,
// source-NATed to snatSrc towards beNode2 out of up0, which entered by up0.
func (e *fwdEnv) snatEntries(fe Frontend, client, snatSrc string) func(t *testing.T, d *Datapath) {
	up0, upMAC0 := e.idx["up0"], e.mac["up0"]
	return both(
		entry{dir: tcCtDirCT_FORWARD, state: tcCtStateCT_TCP_SYN_SENT, addr: ap(beNode2, 8080), nat: snatSrc, redirect: tcCtRedirectCT_REDIRECT_XDP,
			ifindex: up0, smac: upMAC0, dmac: macNode2, iif: up0, svc: fe, backendAddr: ap(beNode2, 8080)}.expect(ctKey(client, fe.Addr.String(), protoTCP)),
		entry{dir: tcCtDirCT_REVERSE, state: tcCtStateCT_TCP_SYN_SENT, addr: fe.Addr.String(), nat: client, redirect: tcCtRedirectCT_REDIRECT_XDP,
			ifindex: up0, smac: upMAC0, dmac: macRouter, iif: up0, svc: fe, backendAddr: ap(beNode2, 8080)}.expect(ctKey(ap(beNode2, 8080), snatSrc, protoTCP)),
	)
}

// up1ReplyEntry expects the reply entry of a flow from client (behind
// up1) to fe, source-NATed to snatSrc towards beNode2: replies go back out
// of up1.
func (e *fwdEnv) up1ReplyEntry(fe Frontend, client, snatSrc string) func(t *testing.T, d *Datapath) {
	return entry{dir: tcCtDirCT_REVERSE, state: tcCtStateCT_TCP_SYN_SENT, addr: fe.Addr.String(), nat: client, redirect: tcCtRedirectCT_REDIRECT_XDP,
		ifindex: e.idx["up1"], smac: e.mac["up1"], dmac: macNode4, iif: e.idx["up0"], svc: fe, backendAddr: ap(beNode2, 8080)}.expect(ctKey(ap(beNode2, 8080), snatSrc, protoTCP))
}

func extFrontend(addr string, proto Protocol) Frontend {
	return Frontend{Addr: netip.MustParseAddrPort(addr), Proto: proto, Scope: ScopeExternal}
}

func local(addr string) Backend {
	return Backend{Addr: netip.MustParseAddrPort(addr), NodeLocal: true}
}

// ap joins an address and a port.
func ap(addr string, port int) string { return fmt.Sprintf("%s:%d", addr, port) }

// TestXDPNorthSouth runs XDP's north-south paths: externalTrafficPolicy
// Local (DNAT, the client's address kept, into the pod through
// tc_uplink), Cluster with a local backend (the same) and with a remote
// one (DNAT and SNAT, XDP_TX or XDP_REDIRECT with the next hop's MACs),
// the replies of each, SNAT ports walking past a taken one, next hops
// learnt later, interfaces topolb does not own, and every fallback.
func TestXDPNorthSouth(t *testing.T) {
	e := newFwdEnv(t, Options{})
	d := e.d
	feLocal := extFrontend(nodeAddr+":30080", TCP)
	sf := newSNATFlows(t, e)
	feCluster, feRemote, feRemoteUDP := sf.feCluster, sf.feRemote, sf.feRemoteUDP
	feNeigh := extFrontend(nodeAddr+":30083", TCP)
	feOther := extFrontend(nodeAddr+":30085", TCP)
	feNoRoute := extFrontend(nodeAddr+":30086", TCP)
	feGone := extFrontend(nodeAddr+":30087", TCP)
	mustSet(t, d, feLocal, local(ap(pod1, 8080)))
	mustSet(t, d, feNeigh, be(ap(beNode3, 8080)))
	mustSet(t, d, feOther, be(ap(beOther, 8080)))
	mustSet(t, d, feNoRoute, be("192.0.2.99:8080"))
	mustSet(t, d, feGone, be(ap(beNode5, 8080)))
	if backendAt(t, d, feCluster, 0) != ap(pod2, 8080) {
		t.Fatal("feCluster's table is not in the order written")
	}
	snat := DefaultSNATPorts
	up0, upMAC0 := e.idx["up0"], e.mac["up0"]

	// eTP Local: DNAT only, into pod1 through tc_uplink.
	cLocal := ap(outside, 40000)
	localSyn := tcpFrame(cLocal, feLocal.Addr.String(), tcpSYN, "")
	localReply := tcpFrame(ap(pod1, 8080), cLocal, tcpSYN|tcpACK, "")
	localTTL := tcpFrame(ap(outside, 40009), feLocal.Addr.String(), tcpSYN, "")
	localTTL.ttl = 1

	// eTP Cluster: a client port that lands on the local backend, one
	// that lands on the remote one.
	cToPod2 := srcFor(t, outside, feCluster, 0, 2, 41000)
	clusterLocal := tcpFrame(cToPod2, feCluster.Addr.String(), tcpSYN, "")

	// UDP, source-translated.
	cUDP := sf.cUDP
	udpZero := udpZeroSumReply(t, udpFrame(ap(beNode2, 5353), ap(nodeAddr, int(sf.udpPort)), ""), feRemoteUDP.Addr.String(), cUDP)

	// A client whose first port is taken by a flow to the same backend.
	cTaken := ap(outside, 43000)
	takenSyn := tcpFrame(cTaken, feRemote.Addr.String(), tcpSYN, "")
	taken0 := snatPortOf(netip.MustParseAddrPort(cTaken), feRemote.Addr, protoTCP, 0, snat)
	taken1 := snatPortOf(netip.MustParseAddrPort(cTaken), feRemote.Addr, protoTCP, 1, snat)
	plantTaken := func(t *testing.T, d *Datapath) {
		k := ctKey(ap(beNode2, 8080), ap(nodeAddr, int(taken0)), protoTCP)
		v := tcCtValue{Dir: uint8(tcCtDirCT_REVERSE), State: uint8(tcCtStateCT_TCP_ESTABLISHED), Expires: nowNS(t) + 3600*sec,
			Flags: uint8(tcCtFlagCT_F_SNAT | tcCtFlagCT_F_REPLIED | tcCtFlagCT_F_ASSURED)}
		putCT(t, d, k, v)
	}

	// A client behind up1: the forward leaves by up0 (XDP_REDIRECT); a
	// large reply to it does not fit up1's MTU.
	cUp1 := sf.cUp1
	bigReply := tcpFrame(ap(beNode2, 8080), ap(nodeAddr, int(sf.up1Port)), tcpACK, string(bytes.Repeat([]byte("x"), 1450-40)))

	// Next hop without a neighbour entry, learnt later.
	cNeigh := ap(outside, 45000)
	neighSyn := tcpFrame(cNeigh, feNeigh.Addr.String(), tcpSYN, "")
	neighPort := snatPortOf(netip.MustParseAddrPort(cNeigh), feNeigh.Addr, protoTCP, 0, snat)
	neighAck := tcpFrame(cNeigh, feNeigh.Addr.String(), tcpACK, "")

	cOther := ap(outside, 46000)
	otherSyn := tcpFrame(cOther, feOther.Addr.String(), tcpSYN, "")
	otherPort := snatPortOf(netip.MustParseAddrPort(cOther), feOther.Addr, protoTCP, 0, snat)

	snatTTL := tcpFrame(ap(outside, 47000), feRemote.Addr.String(), tcpSYN, "")
	snatTTL.ttl = 1
	ttlPort := snatPortOf(netip.MustParseAddrPort(ap(outside, 47000)), feRemote.Addr, protoTCP, 0, snat)

	// A source-NATed flow whose route goes away: its next packet resolves
	// its target again, finds none, and is dropped, not passed up the
	// stack.
	cGone := ap(outside, 49000)
	goneSyn := tcpFrame(cGone, feGone.Addr.String(), tcpSYN, "")
	gonePort := snatPortOf(netip.MustParseAddrPort(cGone), feGone.Addr, protoTCP, 0, snat)
	goneAck := tcpFrame(cGone, feGone.Addr.String(), tcpACK, "")
	removeNode5Route := func(t *testing.T, d *Datapath) {
		t.Helper()
		_, dst, err := net.ParseCIDR("10.244.6.0/24")
		must(t, err)
		must(t, e.node.Netlink().RouteDel(&netlink.Route{LinkIndex: up0, Dst: dst}))
	}

	rows := []pktCase{
		{name: "etp_local_syn_into_the_pod_through_tc_uplink", hook: hookXDP, env: e, iif: "up0", in: localSyn,
			out: ptr(localSyn.withAddrs("", ap(pod1, 8080))), ret: xdpPass,
			meta: handoff(tcCtRedirectCT_REDIRECT_PEER, e.idx["hp1"], e.mac[pod1], e.mac["hp1"], 0),
			fwd:  feLocal, newFlow: true, stats: stats{StatConntrackCreated: 1, StatFwdPeer: 1, StatFwdL2: 1},
			after: e.etpLocalEntries(feLocal, cLocal)},
		{name: "etp_local_reply_out_of_the_uplink", hook: hookTC, env: e, iif: "hp1", in: localReply,
			out: ptr(localReply.withAddrs(feLocal.Addr.String(), "").forwarded(upMAC0, macRouter)), ret: tcRedirect,
			stats: stats{StatReverseNAT: 1}},
		{name: "etp_local_ttl_expiring_goes_up_the_stack", hook: hookXDP, env: e, iif: "up0", in: localTTL,
			out: ptr(localTTL.withAddrs("", ap(pod1, 8080))), ret: xdpPass,
			fwd: feLocal, newFlow: true, stats: stats{StatConntrackCreated: 1, StatFwdPeer: 1, StatFwdL2: 1, StatFwdFallbackTTL: 1}},
		{name: "cluster_local_backend_unknown_mac", hook: hookXDP, env: e, iif: "up0", in: clusterLocal,
			out: ptr(clusterLocal.withAddrs("", ap(pod2, 8080))), ret: xdpPass,
			meta: handoff(tcCtRedirectCT_REDIRECT_PEER, e.idx["hp2"], [6]byte{}, [6]byte{}, 0),
			fwd:  feCluster, newFlow: true, stats: stats{StatConntrackCreated: 1, StatFwdPeer: 1, StatFwdL2: 1}},
	}
	// XDP_TX out of the uplink a frame came in by, XDP_REDIRECT to another.
	rows = append(rows, sf.rows(e, hookXDP, xdpTX, xdpRedirect)...)
	rows = append(rows, []pktCase{
		{name: "udp_reply_checksum_computed_zero_sent_as_all_ones", hook: hookXDP, env: e, iif: "up0", in: udpZero,
			out: ptr(udpZero.withAddrs(feRemoteUDP.Addr.String(), cUDP).forwarded(upMAC0, macRouter)), ret: xdpTX,
			stats: stats{StatReverseNAT: 1}},
		{name: "snat_port_taken_walks_on", hook: hookXDP, env: e, iif: "up0", in: takenSyn, before: plantTaken,
			out: ptr(takenSyn.withAddrs(ap(nodeAddr, int(taken1)), ap(beNode2, 8080)).forwarded(upMAC0, macNode2)), ret: xdpTX,
			fwd: feRemote, newFlow: true, stats: stats{StatConntrackCreated: 1, StatSNATFlows: 1, StatSNATCollision: 1, StatFwdL2: 2}},
		{name: "reply_beyond_the_egress_mtu_goes_up_the_stack", hook: hookXDP, env: e, iif: "up0", in: bigReply,
			out: ptr(bigReply.withAddrs(feRemote.Addr.String(), cUp1)), ret: xdpPass,
			stats: stats{StatReverseNAT: 1, StatFwdFallbackMTU: 1}},
		{name: "snat_next_hop_unknown_handed_to_tc_uplink", hook: hookXDP, env: e, iif: "up0", in: neighSyn,
			out: ptr(neighSyn.withAddrs(ap(nodeAddr, int(neighPort)), ap(beNode3, 8080))), ret: xdpPass,
			meta: handoffNeigh(up0, "10.250.0.3", uint8(tcFwdMetaFlagFWD_META_F_NO_STACK)),
			fwd:  feNeigh, newFlow: true, stats: stats{StatConntrackCreated: 1, StatSNATFlows: 1, StatFwdNeigh: 1, StatFwdL2: 1}},
		{name: "snat_next_hop_learnt_then_xdp_tx", hook: hookXDP, env: e, iif: "up0", in: neighAck,
			before: func(t *testing.T, d *Datapath) { e.neigh(t, "up0", "10.250.0.3", macNode3) },
			out:    ptr(neighAck.withAddrs(ap(nodeAddr, int(neighPort)), ap(beNode3, 8080)).forwarded(upMAC0, macNode3)), ret: xdpTX,
			fwd: feNeigh,
			after: entry{dir: tcCtDirCT_FORWARD, state: tcCtStateCT_TCP_SYN_SENT, addr: ap(beNode3, 8080), nat: ap(nodeAddr, int(neighPort)),
				redirect: tcCtRedirectCT_REDIRECT_XDP, ifindex: up0, smac: upMAC0, dmac: macNode3, iif: up0, svc: feNeigh, backendAddr: ap(beNode3, 8080)}.expect(ctKey(cNeigh, feNeigh.Addr.String(), protoTCP))},
		{name: "snat_through_an_interface_topolb_does_not_own", hook: hookXDP, env: e, iif: "up0", in: otherSyn,
			out: ptr(otherSyn.withAddrs(ap(otherAddr, int(otherPort)), ap(beOther, 8080))), ret: xdpPass,
			meta: handoffNeigh(e.idx["other0"], beOther, uint8(tcFwdMetaFlagFWD_META_F_NO_STACK)),
			fwd:  feOther, newFlow: true, stats: stats{StatConntrackCreated: 1, StatSNATFlows: 1, StatFwdNeigh: 1, StatFwdL2: 1}},
		{name: "snat_without_route_dropped", hook: hookXDP, env: e, iif: "up0", in: tcpFrame(ap(outside, 48000), feNoRoute.Addr.String(), tcpSYN, ""),
			want: drop, stats: stats{StatDropSNATNoRoute: 1}},
		{name: "snat_ttl_expiring_dropped_not_a_martian", hook: hookXDP, env: e, iif: "up0", in: snatTTL, ret: xdpDrop,
			fwd: feRemote, newFlow: true, stats: stats{StatConntrackCreated: 1, StatSNATFlows: 1, StatFwdL2: 2, StatDropSNATFallback: 1},
			after: func(t *testing.T, d *Datapath) {
				readCT(t, d, ctKey(ap(beNode2, 8080), ap(nodeAddr, int(ttlPort)), protoTCP))
			}},
		// Last: they delete a route.
		{name: "snat_flow_whose_route_will_go", hook: hookXDP, env: e, iif: "up0", in: goneSyn,
			out: ptr(goneSyn.withAddrs(ap(nodeAddr, int(gonePort)), ap(beNode5, 8080))), ret: xdpPass,
			meta: handoffNeigh(up0, "10.250.0.5", uint8(tcFwdMetaFlagFWD_META_F_NO_STACK)),
			fwd:  feGone, newFlow: true, stats: stats{StatConntrackCreated: 1, StatSNATFlows: 1, StatFwdNeigh: 1, StatFwdL2: 1}},
		{name: "snat_route_gone_dropped_not_a_martian", hook: hookXDP, env: e, iif: "up0", in: goneAck, before: removeNode5Route,
			ret: xdpDrop, fwd: feGone, stats: stats{StatDropSNATFallback: 1},
			after: entry{dir: tcCtDirCT_FORWARD, state: tcCtStateCT_TCP_SYN_SENT, addr: ap(beNode5, 8080), nat: ap(nodeAddr, int(gonePort)),
				redirect: tcCtRedirectCT_REDIRECT_STACK, iif: up0, svc: feGone, backendAddr: ap(beNode5, 8080)}.expect(ctKey(cGone, feGone.Addr.String(), protoTCP))},
	}...)
	runTable(t, d, rows)
}

// udpZeroSumReply returns reply with a two-byte payload chosen so that,
// translated to src -> dst, its UDP checksum computes to 0, which must go
// on the wire as 0xffff (RFC 768).
func udpZeroSumReply(t *testing.T, reply frame, src, dst string) frame {
	t.Helper()
	for v := 0; v <= 0xffff; v++ {
		reply.payload = []byte{byte(v >> 8), byte(v)}
		x := reply.withAddrs(src, dst)
		x.noUDPSum = true
		b := x.bytes()
		l4 := b[14+20:]
		if csum(pseudo([4]byte(b[26:30]), [4]byte(b[30:34]), protoUDP, len(l4)), l4) == 0 {
			return reply
		}
	}
	t.Fatal("no two-byte payload gives a zero UDP checksum")
	return frame{}
}

// TestSNATPortsExhausted gives SNAT one port, taken: a new flow tries it
// SNATRetries times and is dropped, counted.
func TestSNATPortsExhausted(t *testing.T) {
	one := portrange.Range{Min: 61000, Max: 61000}
	e := newFwdEnv(t, Options{SNATPorts: one})
	f := extFrontend(nodeAddr+":30082", TCP)
	mustSet(t, e.d, f, be(ap(beNode2, 8080)))
	first := ap(outside, 40000)
	second := ap(outside, 40001)
	syn := tcpFrame(first, f.Addr.String(), tcpSYN, "")
	runTable(t, e.d, []pktCase{
		{name: "the_one_port", hook: hookXDP, env: e, iif: "up0", in: syn,
			out: ptr(syn.withAddrs(ap(nodeAddr, 61000), ap(beNode2, 8080)).forwarded(e.mac["up0"], macNode2)), ret: xdpTX,
			fwd: f, newFlow: true, stats: stats{StatConntrackCreated: 1, StatSNATFlows: 1, StatFwdL2: 2}},
		{name: "no_port_left", hook: hookXDP, env: e, iif: "up0", in: tcpFrame(second, f.Addr.String(), tcpSYN, ""),
			want: drop, stats: stats{StatSNATCollision: uint64(SNATRetries), StatDropSNATExhausted: 1}},
	})
}

// TestSNATHandoffBeyondMTU sends a real datagram from outside to a
// frontend whose backend lies behind up1 (MTU 1400) with a next hop the
// node has no neighbour entry for: XDP source-translates it and hands it
// to tc_uplink, which finds it too large for up1. tc_uplink must drop and
// count it as a source-NAT fallback, never pass it up the stack (its
// source is now the node's own address, which the stack takes for a
// martian), as XDP marked it in the metadata.
func TestSNATHandoffBeyondMTU(t *testing.T) {
	e := newFwdEnv(t, Options{UplinkPath: UplinkXDP})
	must(t, e.node.AddRouteDev("10.244.7.0/24", "up1", "10.251.0.7"))
	f := extFrontend(nodeAddr+":30088", UDP)
	mustSet(t, e.d, f, be("10.244.7.10:5353"))
	must(t, e.wire.AddAddr("w0", "10.250.0.9/24"))
	must(t, e.wire.SetOffload("w0", "tx", false))

	before, err := e.d.Counters()
	must(t, err)
	c, err := e.wire.ListenPacket("udp4", "10.250.0.9:0")
	must(t, err)
	defer c.Close()
	big := bytes.Repeat([]byte("x"), 1450)
	if _, err := c.WriteTo(big, net.UDPAddrFromAddrPort(f.Addr)); err != nil {
		t.Fatal(err)
	}
	delta := func(s Stat) uint64 {
		after, err := e.d.Counters()
		must(t, err)
		return after.Stats[s] - before.Stats[s]
	}
	for deadline := time.Now().Add(5 * time.Second); delta(StatDropSNATFallback) == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no source-NAT fallback drop: SNAT flows %d, neigh handoffs %d, MTU fallbacks %d",
				delta(StatSNATFlows), delta(StatFwdNeigh), delta(StatFwdFallbackMTU))
		}
	}
	for s, want := range map[Stat]uint64{StatSNATFlows: 1, StatFwdNeigh: 1, StatDropSNATFallback: 1, StatFwdFallbackMTU: 0} {
		if got := delta(s); got != want {
			t.Errorf("%s delta = %d, want %d", s, got, want)
		}
	}
}

// fwdFamily are the addresses of TestTCForwarding's rows in one family,
// each a host of forward_test.go's picture or its IPv6 half
// (northsouth6_test.go).
type fwdFamily struct {
	name                               string
	ipv6                               bool
	podClient, pod1, pod2              string
	beNode2, beNeigh, beOther, beNode4 string
	vipLocal, vipRemote, vipNoMAC      string
	vipNeigh, vipStack, vipUp1         string
	ipHeader                           int // bytes of the IP header
}

var fwdFamilies = []fwdFamily{
	{name: "ipv4", podClient: podClient, pod1: pod1, pod2: pod2,
		beNode2: beNode2, beNeigh: beNode5, beOther: beOther, beNode4: beNode4,
		vipLocal: "10.96.0.10:80", vipRemote: "10.96.0.11:80", vipNoMAC: "10.96.0.15:80",
		vipNeigh: "10.96.0.12:80", vipStack: "10.96.0.13:80", vipUp1: "10.96.0.14:80", ipHeader: 20},
	{name: "ipv6", ipv6: true, podClient: podClient6, pod1: pod16, pod2: "fd00:244:1::11",
		beNode2: beNode26, beNeigh: beNode36, beOther: beOther6, beNode4: beNode46,
		vipLocal: "[fd00:96::10]:80", vipRemote: "[fd00:96::11]:80", vipNoMAC: "[fd00:96::15]:80",
		vipNeigh: "[fd00:96::12]:80", vipStack: "[fd00:96::13]:80", vipUp1: "[fd00:96::14]:80", ipHeader: 40},
}

// expectFlow checks x's entry under the key from src to dst of proto, in
// the conntrack of their family.
func (x entry) expectFlow(src, dst string, proto uint8) func(t *testing.T, d *Datapath) {
	if netip.MustParseAddrPort(src).Addr().Is6() {
		return x.expect6(ct6Key(src, dst, proto))
	}
	return x.expect(ctKey(src, dst, proto))
}

// TestTCForwarding runs tc's paths after translation, in each family:
// into a local pod with bpf_redirect_peer (the pod's MAC written when the
// node knows it), out of an uplink with the next hop's MACs
// (bpf_redirect) or through the neighbour subsystem (bpf_redirect_neigh),
// replies of both (the remote one through the uplink, handed by XDP to
// tc_uplink), an interface topolb does not own (the stack), TTL (hop
// limit) and MTU fallbacks up the stack, and, in IPv4, a refresh picking
// up a pod's new MAC.
func TestTCForwarding(t *testing.T) {
	for _, f := range fwdFamilies {
		t.Run(f.name, func(t *testing.T) {
			e := newFwdEnvFamilies(t, Options{}, f.ipv6)
			runTable(t, e.d, tcForwardingRows(t, e, f))
		})
	}
}

// tcForwardingRows programs TestTCForwarding's frontends in f's family
// and returns its rows.
func tcForwardingRows(t *testing.T, e *fwdEnv, f fwdFamily) []pktCase {
	d := e.d
	vipLocal, vipRemote, vipNoMAC := fe(f.vipLocal, TCP), fe(f.vipRemote, TCP), fe(f.vipNoMAC, TCP)
	vipNeigh, vipStack, vipUp1 := fe(f.vipNeigh, TCP), fe(f.vipStack, TCP), fe(f.vipUp1, TCP)
	mustSet(t, d, vipLocal, local(ap6(f.pod1, 8080)))
	mustSet(t, d, vipRemote, be(ap6(f.beNode2, 8080)))
	mustSet(t, d, vipNoMAC, local(ap6(f.pod2, 8080)))
	mustSet(t, d, vipNeigh, be(ap6(f.beNeigh, 8080)))
	mustSet(t, d, vipStack, be(ap6(f.beOther, 8080)))
	mustSet(t, d, vipUp1, be(ap6(f.beNode4, 8080)))
	hc, hp1 := e.idx["hc"], e.idx["hp1"]
	c1, c2 := ap6(f.podClient, 40000), ap6(f.podClient, 40001)
	backend1 := ap6(f.pod1, 8080)

	toLocal := tcpFrame(c1, vipLocal.Addr.String(), tcpSYN, "")
	localReply := tcpFrame(backend1, c1, tcpSYN|tcpACK, "")
	localAck := tcpFrame(c1, vipLocal.Addr.String(), tcpACK, "GET / odd")
	toRemote := tcpFrame(c2, vipRemote.Addr.String(), tcpSYN, "")
	remoteReply := tcpFrame(ap6(f.beNode2, 8080), c2, tcpSYN|tcpACK, "")
	toNoMAC := tcpFrame(ap6(f.podClient, 40002), vipNoMAC.Addr.String(), tcpSYN, "")
	toNeigh := tcpFrame(ap6(f.podClient, 40003), vipNeigh.Addr.String(), tcpSYN, "")
	toStack := tcpFrame(ap6(f.podClient, 40004), vipStack.Addr.String(), tcpSYN, "")
	ttl := tcpFrame(ap6(f.podClient, 40005), vipLocal.Addr.String(), tcpSYN, "")
	ttl.ttl = 1
	// 1450 bytes at L3, beyond up1's MTU of 1400.
	big := tcpFrame(ap6(f.podClient, 40006), vipUp1.Addr.String(), tcpACK, strings.Repeat("y", 1450-f.ipHeader-20))

	// The remote backend's reply comes in by up0: XDP translates it and
	// hands it over to tc_uplink, which delivers it, in either family.
	replyRow := pktCase{name: "remote_reply_handed_to_tc_uplink", hook: hookXDP, env: e, iif: "up0", in: remoteReply,
		out: ptr(remoteReply.withAddrs(vipRemote.Addr.String(), "")), ret: xdpPass,
		meta:  handoff(tcCtRedirectCT_REDIRECT_PEER, hc, e.mac[podClient], e.mac["hc"], 0),
		stats: stats{StatReverseNAT: 1}}
	rows := []pktCase{
		{name: "pod_to_local_backend_redirect_peer", hook: hookTC, env: e, iif: "hc", in: toLocal,
			out: ptr(toLocal.withAddrs("", backend1).forwarded(e.mac["hp1"], e.mac[pod1])), ret: tcRedirect,
			fwd: vipLocal, newFlow: true, stats: stats{StatConntrackCreated: 1, StatFwdPeer: 2},
			after: both(
				entry{dir: tcCtDirCT_FORWARD, state: tcCtStateCT_TCP_SYN_SENT, addr: backend1, redirect: tcCtRedirectCT_REDIRECT_PEER,
					ifindex: hp1, smac: e.mac["hp1"], dmac: e.mac[pod1], iif: hc, svc: vipLocal, backendAddr: backend1}.expectFlow(c1, vipLocal.Addr.String(), protoTCP),
				entry{dir: tcCtDirCT_REVERSE, state: tcCtStateCT_TCP_SYN_SENT, addr: vipLocal.Addr.String(), redirect: tcCtRedirectCT_REDIRECT_PEER,
					ifindex: hc, smac: e.mac["hc"], dmac: e.mac[podClient], iif: hp1, svc: vipLocal, backendAddr: backend1}.expectFlow(backend1, c1, protoTCP),
			)},
		{name: "local_reply_into_the_client_pod", hook: hookTC, env: e, iif: "hp1", in: localReply,
			out: ptr(localReply.withAddrs(vipLocal.Addr.String(), "").forwarded(e.mac["hc"], e.mac[podClient])), ret: tcRedirect,
			stats: stats{StatReverseNAT: 1}},
		{name: "next_forward_packet_resolves_again_after_the_state_change", hook: hookTC, env: e, iif: "hc", in: localAck,
			out: ptr(localAck.withAddrs("", backend1).forwarded(e.mac["hp1"], e.mac[pod1])), ret: tcRedirect, fwd: vipLocal,
			stats: stats{StatConntrackPromoted: 1},
			after: entry{dir: tcCtDirCT_FORWARD, state: tcCtStateCT_TCP_ESTABLISHED, addr: backend1, redirect: tcCtRedirectCT_REDIRECT_PEER,
				ifindex: hp1, smac: e.mac["hp1"], dmac: e.mac[pod1], iif: hc, svc: vipLocal, backendAddr: backend1, flags: assuredFlags}.expectFlow(c1, vipLocal.Addr.String(), protoTCP)},
		{name: "pod_to_remote_backend_redirect_with_macs", hook: hookTC, env: e, iif: "hc", in: toRemote,
			out: ptr(toRemote.withAddrs("", ap6(f.beNode2, 8080)).forwarded(e.mac["up0"], macNode2)), ret: tcRedirect,
			fwd: vipRemote, newFlow: true, stats: stats{StatConntrackCreated: 1, StatFwdL2: 1, StatFwdPeer: 1}},
		replyRow,
		{name: "pod_with_unknown_mac_redirect_peer_as_is", hook: hookTC, env: e, iif: "hc", in: toNoMAC,
			out: ptr(toNoMAC.withAddrs("", ap6(f.pod2, 8080)).forwarded(macA, macB)), ret: tcRedirect,
			fwd: vipNoMAC, newFlow: true, stats: stats{StatConntrackCreated: 1, StatFwdPeer: 2}},
		{name: "next_hop_unknown_redirect_neigh", hook: hookTC, env: e, iif: "hc", in: toNeigh,
			out: ptr(toNeigh.withAddrs("", ap6(f.beNeigh, 8080)).forwarded(macA, macB)), ret: tcRedirect,
			fwd: vipNeigh, newFlow: true, stats: stats{StatConntrackCreated: 1, StatFwdNeigh: 1, StatFwdPeer: 1}},
		{name: "interface_not_owned_goes_up_the_stack", hook: hookTC, env: e, iif: "hc", in: toStack,
			out: ptr(toStack.withAddrs("", ap6(f.beOther, 8080))),
			fwd: vipStack, newFlow: true, stats: stats{StatConntrackCreated: 1, StatFwdStack: 1, StatFwdPeer: 1}},
		{name: "ttl_expiring_goes_up_the_stack", hook: hookTC, env: e, iif: "hc", in: ttl,
			out: ptr(ttl.withAddrs("", backend1)),
			fwd: vipLocal, newFlow: true, stats: stats{StatConntrackCreated: 1, StatFwdPeer: 2, StatFwdFallbackTTL: 1}},
		{name: "beyond_the_egress_mtu_goes_up_the_stack", hook: hookTC, env: e, iif: "hc", in: big,
			out: ptr(big.withAddrs("", ap6(f.beNode4, 8080))),
			fwd: vipUp1, newFlow: true, stats: stats{StatConntrackCreated: 1, StatTCPMidflowMiss: 1, StatFwdL2: 1, StatFwdPeer: 1, StatFwdFallbackMTU: 1}},
	}
	if f.ipv6 {
		return rows
	}
	flow1 := flowOf(c1, vipLocal.Addr.String(), backend1, protoTCP)
	return append(rows, pktCase{name: "refresh_picks_up_the_pods_new_mac", hook: hookTC, env: e, iif: "hc", in: localAck,
		before: func(t *testing.T, d *Datapath) {
			e.neigh(t, "hp1", pod1, macPod1b)
			setExpires(flow1, TimeoutTCPEstablished-5*time.Second)(t, d)
		},
		out: ptr(localAck.withAddrs("", backend1).forwarded(e.mac["hp1"], macPod1b)), ret: tcRedirect, fwd: vipLocal,
		after: both(
			entry{dir: tcCtDirCT_FORWARD, state: tcCtStateCT_TCP_ESTABLISHED, addr: backend1, redirect: tcCtRedirectCT_REDIRECT_PEER,
				ifindex: hp1, smac: e.mac["hp1"], dmac: macPod1b, iif: hc, svc: vipLocal, backendAddr: backend1, flags: assuredFlags}.expect(flow1.fwd),
			// The reply's entry resolves again on its next packet.
			entry{dir: tcCtDirCT_REVERSE, state: tcCtStateCT_TCP_ESTABLISHED, addr: vipLocal.Addr.String(), redirect: tcCtRedirectCT_REDIRECT_NEIGH,
				ifindex: hc, smac: e.mac["hc"], dmac: e.mac[podClient], iif: hp1, svc: vipLocal, backendAddr: backend1, flags: assuredFlags}.expect(flow1.rev),
		)})
}
