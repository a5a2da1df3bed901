package maps

import (
	"net/netip"
	"path/filepath"
	"testing"

	"github.com/topolb/topolb/internal/nettest"
)

// TestHostNetworkBackend: a backend that is a process of the node itself
// (a host-network pod, such as the API server behind default/kubernetes on
// a control-plane node). Its replies leave the node's sockets, so no
// ingress program sees them: tc_lb_egress translates them back, on the pod
// veth for a pod client and on the uplink for an outside client. Without
// it a pod's TCP connection never completes (its SYN-ACK comes from an
// address it never called) and a UDP answer comes from the wrong address.
func TestHostNetworkBackend(t *testing.T) {
	requirePrivileges(t)
	pin := filepath.Join(bpffs(t), "topolb")
	tb := newTestbed(t)
	d := newDatapath(t, Options{PinPath: pin, NetNS: tb.node1.Path})

	// node1's own processes. The UDP server binds the backend address:
	// one on the wildcard address answers from the address of the route
	// back (here 10.1.0.1 towards the pod), a flow no proxy knows, as
	// with kube-proxy's netfilter.
	tb.node1.ServeHTTPName(t, ":8080", "node1")
	tb.node1.ServeUDPName(t, "10.9.0.1:5353", "node1")
	host := func(port uint16) Backend {
		return Backend{Addr: netip.AddrPortFrom(netip.MustParseAddr("10.9.0.1"), port), NodeLocal: true, ZoneLocal: true}
	}
	const vipHTTP, vipDNS = "10.96.0.20:80", "10.96.0.20:53"
	mustSet(t, d, fe(vipHTTP, TCP), host(8080))
	mustSet(t, d, fe(vipDNS, UDP), host(5353))
	// node1's NodePort, reached from node2 across the wire: an outside
	// client of node1.
	const npHTTP, npDNS = "10.9.0.1:30080", "10.9.0.1:30053"
	ext := func(addr string, proto Protocol) Frontend {
		f := fe(addr, proto)
		f.Scope = ScopeExternal
		return f
	}
	mustSet(t, d, ext(npHTTP, TCP), host(8080))
	mustSet(t, d, ext(npDNS, UDP), host(5353))
	must(t, d.AttachPod("hc"))
	must(t, d.AttachUplink("w1"))

	const n = 20
	for _, c := range []struct {
		name      string
		from      *nettest.NS
		http, udp string
	}{
		{"pod client", tb.client, vipHTTP, vipDNS},
		{"outside client", tb.node2, npHTTP, npDNS},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := httpGets(t, c.from, "http://"+c.http+"/", n); got["node1"] != n {
				t.Errorf("HTTP answers %v, want %d from node1", got, n)
			}
			// udpQueries fails on an answer from any other address than
			// the frontend's.
			if got := udpQueries(t, c.from, c.udp, n); got["node1"] != n {
				t.Errorf("UDP answers %v, want %d from node1", got, n)
			}
		})
	}
	c, err := d.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if c.Drops != (Drops{}) {
		t.Errorf("drops: %+v", c.Drops)
	}
	if c.ReverseNAT < 4*n {
		t.Errorf("reverse NAT %d, want at least %d (every reply of both clients)", c.ReverseNAT, 4*n)
	}
	for name, ns := range tb.all() {
		if ce, err := ns.ChecksumErrors(); err != nil || ce != (nettest.ChecksumErrors{}) {
			t.Errorf("%s: checksum errors %+v, %v", name, ce, err)
		}
	}
}
