package testbed

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/kube"
)

// RouterPort is the router's port on the switch.
const RouterPort = "r0"

// forwardingSysctls make a namespace a router that forwards packets whose
// source is not on the interface they arrive on: reverse-NATed replies
// carry a service address as source.
var forwardingSysctls = [][2]string{
	{"net.ipv4.ip_forward", "1"},
	{"net.ipv4.conf.all.rp_filter", "0"},
	{"net.ipv4.conf.default.rp_filter", "0"},
}

// forwardingSysctls6 are forwardingSysctls' IPv6 twins, for a dual-stack
// testbed (IPv6 has no reverse path filter of its own).
var forwardingSysctls6 = [][2]string{
	{"net.ipv6.conf.all.forwarding", "1"},
	{"net.ipv6.conf.default.forwarding", "1"},
}

// makeRouter makes ns forward (forwardingSysctls, and forwardingSysctls6
// in a dual-stack testbed). Call it before ns has interfaces, so every
// interface inherits the defaults.
func (tb *Testbed) makeRouter(ns *NS) error {
	kvs := forwardingSysctls
	if tb.Spec.DualStack {
		kvs = append(slices.Clone(kvs), forwardingSysctls6...)
	}
	for _, kv := range kvs {
		if err := ns.Sysctl(kv[0], kv[1]); err != nil {
			return err
		}
	}
	return nil
}

// buildOutside creates the router, plugs it into the wire, wires the
// outside clients to it and routes the outside subnet from every node.
func (tb *Testbed) buildOutside() (err error) {
	r := tb.Router
	if r == nil {
		return nil
	}
	if r.NS, err = tb.newNS("", "router"); err != nil {
		return err
	}
	if err := tb.makeRouter(r.NS); err != nil {
		return err
	}
	if err := tb.plugIntoWire(r.NS, RouterPort, 0, false, r.WireAddr, r.WireAddr6); err != nil {
		return err
	}
	for _, e := range tb.Externals {
		if e.NS, err = tb.newNS("x-", e.Name); err != nil {
			return err
		}
		if err := wirePointToPoint(r.NS, e.RouterIf, e.NS, ExternalIfName, hostRoute{r.Gateway, e.Addr}, hostRoute{r.Gateway6, e.Addr6}); err != nil {
			return err
		}
		if err := r.NS.SetAlias(e.RouterIf, e.Name); err != nil {
			return err
		}
	}
	for _, n := range tb.Nodes {
		if err := n.NS.AddRouteDev(r.Subnet.String(), UplinkName, r.WireAddr.Addr().String()); err != nil {
			return err
		}
		if r.Subnet6.IsValid() {
			if err := n.NS.AddRouteDev(r.Subnet6.String(), UplinkName, r.WireAddr6.Addr().String()); err != nil {
				return err
			}
		}
	}
	if tb.Spec.Outside.RouteServiceRange {
		if err := r.NS.AddRouteDev(serviceRange.String(), UplinkName, r.Ingress.WireAddr.Addr().String()); err != nil {
			return fmt.Errorf("router: route the service range: %w", err)
		}
		if r.Subnet6.IsValid() {
			if err := r.NS.AddRouteDev(serviceRanges[ipv6].String(), UplinkName, r.Ingress.WireAddr6.Addr().String()); err != nil {
				return fmt.Errorf("router: route the IPv6 service range: %w", err)
			}
		}
	}
	return nil
}

// routeOutsideIPs makes the router send every external IP and
// load-balancer IP of objs to the ingress node (IPv6 ones to its IPv6
// address, in a dual-stack testbed), and removes the routes of addresses
// no Service has any more.
func (tb *Testbed) routeOutsideIPs(objs *kube.Objects) error {
	r := tb.Router
	if r == nil || r.NS == nil {
		return nil
	}
	want := map[netip.Addr]bool{}
	for _, svc := range objs.Services {
		var ips []string
		ips = append(ips, svc.Spec.ExternalIPs...)
		for _, in := range svc.Status.LoadBalancer.Ingress {
			ips = append(ips, in.IP)
		}
		for _, s := range ips {
			if ip, err := netip.ParseAddr(s); err == nil && (ip.Is4() || r.WireAddr6.IsValid()) {
				want[ip] = true
			}
		}
	}
	nl := r.NS.Netlink()
	up, err := nl.LinkByName(UplinkName)
	if err != nil {
		return fmt.Errorf("router: %w", err)
	}
	var errs []error
	have := map[netip.Addr]bool{}
	for _, fam := range []struct {
		nl  int
		via netip.Addr
	}{{netlink.FAMILY_V4, r.Ingress.WireAddr.Addr()}, {netlink.FAMILY_V6, r.Ingress.WireAddr6.Addr()}} {
		if !fam.via.IsValid() {
			continue
		}
		routes, err := nl.RouteList(up, fam.nl)
		if err != nil {
			return fmt.Errorf("router: list routes: %w", err)
		}
		for _, rt := range routes {
			if rt.Dst == nil || rt.Gw == nil {
				continue
			}
			ones, bits := rt.Dst.Mask.Size()
			dst, ok := netip.AddrFromSlice(rt.Dst.IP)
			if !ok || ones != bits {
				continue
			}
			dst = dst.Unmap()
			gw, _ := netip.AddrFromSlice(rt.Gw)
			if want[dst] && gw.Unmap() == fam.via {
				have[dst] = true
				continue
			}
			if err := nl.RouteDel(&rt); err != nil {
				errs = append(errs, fmt.Errorf("router: delete route to %s: %w", dst, err))
			}
		}
	}
	for ip := range want {
		if have[ip] {
			continue
		}
		via := r.Ingress.WireAddr.Addr()
		if ip.Is6() {
			via = r.Ingress.WireAddr6.Addr()
		}
		rt := &netlink.Route{
			LinkIndex: up.Attrs().Index,
			Dst:       &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(ip.BitLen(), ip.BitLen())},
			Gw:        via.AsSlice(),
		}
		if err := nl.RouteReplace(rt); err != nil {
			errs = append(errs, fmt.Errorf("router: route %s via %s: %w", ip, via, err))
		}
	}
	return errors.Join(errs...)
}

// setNetfilter sets up a node's netfilter as its spec says.
func (tb *Testbed) setNetfilter(n *Node) error {
	nf := n.Netfilter
	if nf.TCPBeLiberal != nil {
		v := "0"
		if *nf.TCPBeLiberal {
			v = "1"
		}
		if err := n.NS.Sysctl("net.netfilter.nf_conntrack_tcp_be_liberal", v); err != nil {
			return fmt.Errorf("node %s: %w (is nf_conntrack available?)", n.Name, err)
		}
	}
	if nf.InvalidDrop {
		if err := runIn(n.NS, "iptables", "-w", "-I", "FORWARD", "-m", "conntrack", "--ctstate", "INVALID",
			"-m", "comment", "--comment", InvalidDropComment, "-j", "DROP"); err != nil {
			return fmt.Errorf("node %s: install the INVALID drop rule: %w", n.Name, err)
		}
	}
	return nil
}

// InvalidDropComment marks the INVALID drop rule the testbed installs
// (NetfilterSpec.InvalidDrop).
const InvalidDropComment = "testbed: kube-proxy (iptables mode) drops conntrack INVALID"

// runIn runs a command in ns (nsenter --net) and returns its error with
// its output.
func runIn(ns *NS, args ...string) error {
	_, err := outputIn(context.Background(), ns, args...)
	return err
}

// outputIn runs a command in ns and returns its standard output.
func outputIn(ctx context.Context, ns *NS, args ...string) ([]byte, error) {
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, "nsenter", append([]string{"--net=" + ns.Path}, args...)...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("%s in %s: %w: %s", strings.Join(args, " "), ns.Name, err, bytes.TrimSpace(stderr.Bytes()))
	}
	return out, nil
}

// CheckNoKubeProxy reports an error naming every node whose netfilter
// holds kube-proxy's rules: an nftables table named kube-proxy, or
// iptables chains named KUBE-*. It is how a test proves it ran with no
// kube-proxy anywhere (Spec.KubeProxy "none").
func (tb *Testbed) CheckNoKubeProxy(ctx context.Context) error {
	var errs []error
	for _, n := range tb.Nodes {
		tables, err := outputIn(ctx, n.NS, "nft", "list", "tables")
		if err != nil {
			return err
		}
		if bytes.Contains(tables, []byte(" kube-proxy")) {
			errs = append(errs, fmt.Errorf("node %s: nftables has kube-proxy's table:\n%s", n.Name, tables))
		}
		save, err := outputIn(ctx, n.NS, "iptables-save")
		if err != nil {
			return err
		}
		for _, line := range strings.Split(string(save), "\n") {
			if strings.HasPrefix(line, ":KUBE-") {
				errs = append(errs, fmt.Errorf("node %s: iptables has kube-proxy's chain %s", n.Name, strings.Fields(line)[0][1:]))
				break
			}
		}
	}
	return errors.Join(errs...)
}

// ClientName returns the outside client's name.
func (e *External) ClientName() string { return e.Name }

// ClientAddr returns the outside client's address.
func (e *External) ClientAddr() netip.Addr { return e.Addr }

// ClientAddrOf returns the outside client's address of family, invalid
// when it has none.
func (e *External) ClientAddrOf(family v1.IPFamily) netip.Addr { return pick(family, e.Addr, e.Addr6) }

// Open opens a flow from the outside client to target.
func (e *External) Open(ctx context.Context, proto v1.Protocol, target netip.AddrPort) (*Conn, error) {
	return open(ctx, proto, target, e.NS.DialContext)
}

// Request sends one request from the outside client to target on a new
// flow and returns the answer.
func (e *External) Request(ctx context.Context, proto v1.Protocol, target netip.AddrPort) (Answer, error) {
	return request(ctx, proto, target, e.NS.DialContext)
}

// Send runs the load from the outside client; see Pod.Send.
func (e *External) Send(ctx context.Context, l Load) []Record { return send(ctx, e.NS, l) }

// FloodUDP sends count copies of one UDP datagram from the outside client
// to target, injected where the client's frames arrive: the router's veth
// to the client. The router forwards them onto the wire, so a node's XDP
// program on its uplink sees them as real frames; see Pod.FloodUDP. The
// datagram is of target's family, from e's address of that family.
func (e *External) FloodUDP(target netip.AddrPort, count int) (FloodResult, error) {
	router := iface{e.Router.NS, e.RouterIf}
	return floodUDP(injection{at: router, action: xdpPass, src: iface{e.NS, ExternalIfName}, dst: router},
		netip.AddrPortFrom(e.ClientAddrOf(familyOf(target.Addr())), floodSourcePort), target, count)
}

// Client sends requests from inside the testbed: a Pod, or an External
// client outside the cluster.
type Client interface {
	ClientName() string
	ClientAddr() netip.Addr
	// ClientAddrOf is the client's address of a family (ClientAddr for
	// IPv4), invalid when it has none.
	ClientAddrOf(family v1.IPFamily) netip.Addr
	Open(ctx context.Context, proto v1.Protocol, target netip.AddrPort) (*Conn, error)
	Request(ctx context.Context, proto v1.Protocol, target netip.AddrPort) (Answer, error)
	Send(ctx context.Context, l Load) []Record
	FloodUDP(target netip.AddrPort, count int) (FloodResult, error)
}

var (
	_ Client = (*Pod)(nil)
	_ Client = (*External)(nil)
)
