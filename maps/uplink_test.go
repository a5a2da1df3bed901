package maps

import (
	"bytes"
	"context"
	"io"
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	"github.com/topolb/topolb/internal/nettest"
)

// hookUplinkTC selects, in packet tables, tc_uplink_lb: the tcx ingress
// program of an uplink on the tc path (UplinkTC).
const hookUplinkTC hook = "uplink-tc"

// TestTCUplinkNorthSouth runs the north-south paths of TestXDPNorthSouth
// through tc_uplink_lb, an uplink's tc path: the same decisions and
// conntrack entries, delivered as skbs. externalTrafficPolicy Local (DNAT
// into the pod with bpf_redirect_peer), Cluster with a remote backend
// (DNAT and SNAT, bpf_redirect out of the uplink with the next hop's MACs,
// on the same uplink or another one), the replies, UDP, an unknown next
// hop (bpf_redirect_neigh), and the fallbacks that must not reach the
// stack.
func TestTCUplinkNorthSouth(t *testing.T) {
	e := newFwdEnv(t, Options{UplinkPath: UplinkTC})
	d := e.d
	feLocal := extFrontend(nodeAddr+":30080", TCP)
	sf := newSNATFlows(t, e)
	feNeigh := extFrontend(nodeAddr+":30083", TCP)
	mustSet(t, d, feLocal, local(ap(pod1, 8080)))
	mustSet(t, d, feNeigh, be(ap(beNode3, 8080)))

	cLocal := ap(outside, 40000)
	localSyn := tcpFrame(cLocal, feLocal.Addr.String(), tcpSYN, "")
	cNeigh := ap(outside, 45000)
	neighSyn := tcpFrame(cNeigh, feNeigh.Addr.String(), tcpSYN, "")
	neighPort := snatPortOf(netip.MustParseAddrPort(cNeigh), feNeigh.Addr, protoTCP, 0, DefaultSNATPorts)
	snatTTL := tcpFrame(ap(outside, 47000), sf.feRemote.Addr.String(), tcpSYN, "")
	snatTTL.ttl = 1
	established := tcpFrame(sf.cToNode2, sf.feCluster.Addr.String(), tcpACK, "more")

	rows := []pktCase{
		{name: "etp_local_syn_into_the_pod_redirect_peer", hook: hookUplinkTC, env: e, iif: "up0", in: localSyn,
			out: ptr(localSyn.withAddrs("", ap(pod1, 8080)).forwarded(e.mac["hp1"], e.mac[pod1])), ret: tcRedirect,
			fwd: feLocal, newFlow: true, stats: stats{StatConntrackCreated: 1, StatFwdPeer: 1, StatFwdL2: 1},
			after: e.etpLocalEntries(feLocal, cLocal)},
	}
	// bpf_redirect out of the uplink, the same one or another.
	rows = append(rows, sf.rows(e, hookUplinkTC, tcRedirect, tcRedirect)...)
	rows = append(rows, []pktCase{
		{name: "established_flow_of_the_tc_path_goes_on_in_xdp", hook: hookXDP, env: e, iif: "up0", in: established,
			out: ptr(established.withAddrs(sf.snatSrc, ap(beNode2, 8080)).forwarded(e.mac["up0"], macNode2)), ret: xdpTX, fwd: sf.feCluster},
		{name: "snat_next_hop_unknown_redirect_neigh", hook: hookUplinkTC, env: e, iif: "up0", in: neighSyn,
			out: ptr(neighSyn.withAddrs(ap(nodeAddr, int(neighPort)), ap(beNode3, 8080)).forwarded(macA, macB)), ret: tcRedirect,
			fwd: feNeigh, newFlow: true, stats: stats{StatConntrackCreated: 1, StatSNATFlows: 1, StatFwdNeigh: 1, StatFwdL2: 1}},
		{name: "snat_ttl_expiring_dropped_not_a_martian", hook: hookUplinkTC, env: e, iif: "up0", in: snatTTL, ret: tcShot,
			fwd: sf.feRemote, newFlow: true, stats: stats{StatConntrackCreated: 1, StatSNATFlows: 1, StatFwdL2: 2, StatDropSNATFallback: 1}},
		{name: "not_a_frontend_passes_untouched", hook: hookUplinkTC, env: e, iif: "up0",
			in: tcpFrame(ap(outside, 48000), nodeAddr+":22", tcpSYN, "")},
		{name: "internal_frontend_not_matched", hook: hookUplinkTC, env: e, iif: "up0",
			before: func(t *testing.T, d *Datapath) { mustSet(t, d, fe("10.96.0.10:80", TCP), be(ap(beNode2, 8080))) },
			in:     tcpFrame(ap(outside, 48001), "10.96.0.10:80", tcpSYN, "")},
	}...)
	runTable(t, d, rows)
}

// uplinkEnv is a node whose uplink up0 (10.250.0.1/24) is a veth to a
// wire namespace that holds both an outside client (10.250.0.9, w0's
// first address) and a backend on another node (10.250.0.2:8080): a flow
// from the client to the node's external frontend is source-NATed and
// sent back out of up0, the frame XDP_TX loses when w0 has no NAPI.
type uplinkEnv struct {
	node, wire *nettest.NS
	pin        string
	fe         Frontend
}

const (
	uplinkClient  = "10.250.0.9"
	uplinkBackend = "10.250.0.2:8080"
)

// The peers an uplink env's w0 can be.
type uplinkPeer string

const (
	peerPlain uplinkPeer = "plain" // no XDP program, GRO off: no NAPI
	peerGRO   uplinkPeer = "gro"   // GRO on
	peerXDP   uplinkPeer = "xdp"   // a native XDP program that passes all
)

// newUplinkEnv builds the namespaces with w0 as peer says, and transmit
// checksum offload on w0 as txCsum says (on: the client's packets arrive
// CHECKSUM_PARTIAL).
func newUplinkEnv(t *testing.T, peer uplinkPeer, txCsum bool) *uplinkEnv {
	t.Helper()
	requirePrivileges(t)
	if err := nettest.RemoveStale(); err != nil {
		t.Logf("removing stale namespaces: %v", err)
	}
	e := &uplinkEnv{node: nettest.NewNS(t, "up-node"), wire: nettest.NewNS(t, "up-wire"),
		pin: filepath.Join(bpffs(t), "topolb"), fe: extFrontend(nodeAddr+":30082", TCP)}
	must(t, e.node.Sysctl("net.ipv4.ip_forward", "1"))
	must(t, nettest.Veth(e.node, "up0", e.wire, "w0"))
	must(t, e.node.AddAddr("up0", nodeAddr+"/24"))
	must(t, e.wire.AddAddr("w0", uplinkClient+"/24"))
	must(t, e.wire.AddAddr("w0", "10.250.0.2/24"))
	must(t, e.node.SetOffload("up0", "tx", false))
	must(t, e.wire.SetOffload("w0", "tx", txCsum))
	must(t, e.wire.SetGRO("w0", peer == peerGRO))
	if peer == peerXDP {
		xdpPassOn(t, e.wire, "w0")
	}
	e.wire.ServeHTTPName(t, uplinkBackend, "remote")
	return e
}

// load loads (or adopts) the datapath with path, programs the frontend
// and attaches the uplink.
func (e *uplinkEnv) load(t *testing.T, path UplinkPath) *Datapath {
	t.Helper()
	d := newDatapath(t, Options{PinPath: e.pin, NetNS: e.node.Path, UplinkPath: path})
	mustSet(t, d, e.fe, be(uplinkBackend))
	must(t, d.AttachUplink("up0"))
	return d
}

// uplinkPath reads up0's path back from the kernel.
func uplinkPath(t *testing.T, d *Datapath) UplinkStatus {
	t.Helper()
	ups, err := d.Uplinks()
	must(t, err)
	if len(ups) != 1 || ups[0].Interface != "up0" {
		t.Fatalf("Uplinks() = %+v, want up0 alone", ups)
	}
	return ups[0]
}

// TestUplinkPathDelivers sends real HTTP from outside to a frontend whose
// backend is on another node, through a veth uplink, on each path: the
// reply and the forward packets leave by the uplink they arrived on. With
// a peer without NAPI (no XDP program, no GRO: a kind node's eth0) XDP's
// frames are dropped by the kernel, and tc delivers; auto chooses tc
// there and for a peer with GRO only, XDP for a peer with a native XDP
// program. The xdp_plain_peer row is the proof that this test fails
// where north-south is black-holed.
func TestUplinkPathDelivers(t *testing.T) {
	for _, c := range []struct {
		name string
		path UplinkPath
		peer uplinkPeer
		// txCsum keeps the client's transmit checksum offload
		// (CHECKSUM_PARTIAL).
		txCsum    bool
		wantPath  string
		delivered bool
	}{
		{name: "tc_plain_peer_partial_checksums", path: UplinkTC, peer: peerPlain, txCsum: true, wantPath: "tc", delivered: true},
		{name: "tc_plain_peer_full_checksums", path: UplinkTC, peer: peerPlain, wantPath: "tc", delivered: true},
		{name: "auto_plain_peer_chooses_tc", path: UplinkAuto, peer: peerPlain, txCsum: true, wantPath: "tc", delivered: true},
		{name: "xdp_plain_peer_black_holed", path: UplinkXDP, peer: peerPlain, wantPath: "xdp", delivered: false},
		{name: "auto_peer_with_gro_chooses_tc", path: UplinkAuto, peer: peerGRO, wantPath: "tc", delivered: true},
		{name: "auto_peer_with_xdp_chooses_xdp", path: UplinkAuto, peer: peerXDP, wantPath: "xdp", delivered: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newUplinkEnv(t, c.peer, c.txCsum)
			d := e.load(t, c.path)
			st := uplinkPath(t, d)
			t.Logf("up0: %+v", st)
			if st.Path != c.wantPath {
				t.Fatalf("path %q, want %q", st.Path, c.wantPath)
			}
			if c.path == UplinkAuto && st.Reason == "" {
				t.Error("auto chose without a reason")
			}
			before, err := d.Counters()
			must(t, err)
			const n = 20
			got := 0
			client := e.wire.HTTPClient(time.Second)
			for i := 0; i < n; i++ {
				resp, err := client.Get("http://" + e.fe.Addr.String() + "/")
				if err != nil {
					if c.delivered {
						t.Fatalf("request %d: %v", i, err)
					}
					break
				}
				body, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				must(t, err)
				if string(body) != "remote" {
					t.Fatalf("answer %q, want remote", body)
				}
				got++
			}
			after, err := d.Counters()
			must(t, err)
			snat := after.Stats[StatSNATFlows] - before.Stats[StatSNATFlows]
			t.Logf("%d of %d answered; %d flows source-NATed", got, n, snat)
			if snat == 0 {
				t.Fatal("no flow was source-NATed: the datapath never saw the traffic")
			}
			if c.delivered && got != n {
				t.Errorf("%d of %d answered", got, n)
			}
			if !c.delivered && got != 0 {
				t.Errorf("%d answered through an XDP uplink whose peer has no NAPI: the kernel delivered what it should drop, so this test would not catch a black hole", got)
			}
			for name, ns := range map[string]*nettest.NS{"node": e.node, "wire": e.wire} {
				if ce, err := ns.ChecksumErrors(); err != nil || ce != (nettest.ChecksumErrors{}) {
					t.Errorf("%s: checksum errors %+v, %v", name, ce, err)
				}
			}
		})
	}
}

// TestUplinkPathSwitchKeepsFlows restarts the datapath with the other
// uplink path under an open connection, xdp -> tc -> xdp: the new path
// swaps in place of the old and finds the flow in the same conntrack, so
// the connection goes on (the peer has an XDP program, so both paths
// deliver).
func TestUplinkPathSwitchKeepsFlows(t *testing.T) {
	e := newUplinkEnv(t, peerXDP, false)
	// An echo backend on the wire, beside the HTTP one.
	const echoAddr = "10.250.0.2:7000"
	serveEcho(t, e.wire, echoAddr)
	echoFE := extFrontend(nodeAddr+":30070", TCP)

	d := e.load(t, UplinkXDP)
	mustSet(t, d, echoFE, be(echoAddr))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := e.wire.DialContext(ctx, "tcp4", echoFE.Addr.String())
	must(t, err)
	defer conn.Close()
	echo := func(step string) {
		t.Helper()
		msg := []byte("still here after " + step)
		must(t, conn.SetDeadline(time.Now().Add(3*time.Second)))
		if _, err := conn.Write(msg); err != nil {
			t.Fatalf("%s: write: %v", step, err)
		}
		buf := make([]byte, len(msg))
		if _, err := io.ReadFull(conn, buf); err != nil {
			t.Fatalf("%s: the established connection broke: %v", step, err)
		}
		if !bytes.Equal(buf, msg) {
			t.Fatalf("%s: echo %q, want %q", step, buf, msg)
		}
	}
	echo("xdp")
	for _, path := range []UplinkPath{UplinkTC, UplinkXDP} {
		must(t, d.Close())
		d = e.load(t, path)
		if st := uplinkPath(t, d); st.Path != string(path) {
			t.Fatalf("after the switch to %s: path %q (%+v)", path, st.Path, st)
		}
		before, err := d.Counters()
		must(t, err)
		echo(string(path))
		after, err := d.Counters()
		must(t, err)
		if n := after.Stats[StatConntrackCreated] - before.Stats[StatConntrackCreated]; n != 0 {
			t.Errorf("%s: %d flows created: the connection was balanced again instead of found in conntrack", path, n)
		}
		if n := after.Stats[StatReverseNAT] - before.Stats[StatReverseNAT]; n == 0 {
			t.Errorf("%s: no reply translated by the datapath", path)
		}
	}
}
