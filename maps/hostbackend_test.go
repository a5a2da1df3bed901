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
// In both families; IPv6 from a pod only (the uplinks do not translate
// IPv6, so no NodePort of it is reached from outside).
func TestHostNetworkBackend(t *testing.T) {
	requirePrivileges(t)
	pin := filepath.Join(bpffs(t), "topolb")
	tb := newTestbed(t)
	tb.dualStack(t)
	d := newDatapath(t, Options{PinPath: pin, NetNS: tb.node1.Path})
	must(t, d.AttachPod("hc"))
	must(t, d.AttachUplink("w1"))

	const n = 20
	replies := 0
	for _, fam := range []struct {
		name, node      string
		vipHTTP, vipDNS string
		npHTTP, npDNS   string // node1's NodePorts, reached from node2 across the wire; "" for none
	}{
		{"ipv4", "10.9.0.1", "10.96.0.20:80", "10.96.0.20:53", "10.9.0.1:30080", "10.9.0.1:30053"},
		{"ipv6", "fd00:9::1", "[fd00:96::20]:80", "[fd00:96::20]:53", "", ""},
	} {
		node := netip.MustParseAddr(fam.node)
		// node1's own processes, on the backend address. The UDP
		// server must bind it: one on the wildcard address answers
		// from the address of the route back (here the node's address
		// towards the pod), a flow no proxy knows, as with kube-proxy's
		// netfilter.
		tb.node1.ServeHTTPName(t, netip.AddrPortFrom(node, 8080).String(), "node1")
		tb.node1.ServeUDPName(t, netip.AddrPortFrom(node, 5353).String(), "node1")
		host := func(port uint16) Backend {
			return Backend{Addr: netip.AddrPortFrom(node, port), NodeLocal: true, ZoneLocal: true}
		}
		mustSet(t, d, fe(fam.vipHTTP, TCP), host(8080))
		mustSet(t, d, fe(fam.vipDNS, UDP), host(5353))
		clients := []struct {
			name      string
			from      *nettest.NS
			http, udp string
		}{{"pod_client", tb.client, fam.vipHTTP, fam.vipDNS}}
		if fam.npHTTP != "" {
			ext := func(addr string, proto Protocol) Frontend {
				f := fe(addr, proto)
				f.Scope = ScopeExternal
				return f
			}
			mustSet(t, d, ext(fam.npHTTP, TCP), host(8080))
			mustSet(t, d, ext(fam.npDNS, UDP), host(5353))
			clients = append(clients, struct {
				name      string
				from      *nettest.NS
				http, udp string
			}{"outside_client", tb.node2, fam.npHTTP, fam.npDNS})
		}
		for _, c := range clients {
			t.Run(fam.name+"/"+c.name, func(t *testing.T) {
				if got := httpGets(t, c.from, "http://"+c.http+"/", n); got["node1"] != n {
					t.Errorf("HTTP answers %v, want %d from node1", got, n)
				}
				// udpQueries fails on an answer from any other address
				// than the frontend's.
				if got := udpQueries(t, c.from, c.udp, n); got["node1"] != n {
					t.Errorf("UDP answers %v, want %d from node1", got, n)
				}
			})
			replies += 2 * n
		}
	}
	c, err := d.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if c.Drops != (Drops{}) {
		t.Errorf("drops: %+v", c.Drops)
	}
	if c.ReverseNAT < uint64(replies) {
		t.Errorf("reverse NAT %d, want at least %d (every reply of every client)", c.ReverseNAT, replies)
	}
	for name, ns := range tb.all() {
		if ce, err := ns.ChecksumErrors(); err != nil || ce != (nettest.ChecksumErrors{}) {
			t.Errorf("%s: checksum errors %+v, %v", name, ce, err)
		}
	}
}
