package testbed

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"

	v1 "k8s.io/api/core/v1"
)

// HostClient is a process of a node's own network namespace: a
// host-network client (a node-local DNS cache, a monitoring agent, a
// kubelet plugin). Its sockets are opened in the node's namespace by this
// process, on a locked OS thread; topolb balances them with its socket
// hooks, kube-proxy with its OUTPUT rules.
type HostClient struct {
	Node *Node
}

var _ Client = (*HostClient)(nil)

// Host returns the host-network client of the named node, nil when there
// is no such node.
func (tb *traffic) Host(node string) *HostClient {
	n := tb.Node(node)
	if n == nil {
		return nil
	}
	return &HostClient{Node: n}
}

// ClientName returns "host/<node>".
func (h *HostClient) ClientName() string { return "host/" + h.Node.Name }

// ClientAddr returns the node's wire address: the source backends on other
// nodes see. Backends on the node itself see its pod gateway address, so
// measurements of host clients do not hold backends to one source.
func (h *HostClient) ClientAddr() netip.Addr { return h.Node.WireAddr.Addr() }

// ClientAddrOf returns the node's wire address of family, invalid when it
// has none.
func (h *HostClient) ClientAddrOf(family v1.IPFamily) netip.Addr {
	return pick(family, h.Node.WireAddr, h.Node.WireAddr6).Addr()
}

// ErrPeerNotTarget is returned by a host client's Open when the connected
// socket's peer (getpeername) is not the address it connected to: a
// service proxy that translates a host-network socket must show the
// service address, not the backend it chose.
var ErrPeerNotTarget = errors.New("getpeername does not name the address connected to")

// peerChecked wraps dial: a connection whose peer (getpeername, which Go
// reads once connected) is not the address dialed is closed and refused
// with ErrPeerNotTarget.
func peerChecked(dial dialFunc) dialFunc {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		if peer, perr := netip.ParseAddrPort(c.RemoteAddr().String()); perr != nil || peer.String() != addr {
			c.Close()
			return nil, fmt.Errorf("%s to %s: peer %s: %w", network, addr, c.RemoteAddr(), ErrPeerNotTarget)
		}
		return c, nil
	}
}

// Open opens a flow from the node's own network namespace to target; its
// peer must be target.
func (h *HostClient) Open(ctx context.Context, proto v1.Protocol, target netip.AddrPort) (*Conn, error) {
	return open(ctx, proto, target, peerChecked(h.Node.NS.DialContext))
}

// Request sends one request from the node's own network namespace to
// target on a new flow and returns the answer.
func (h *HostClient) Request(ctx context.Context, proto v1.Protocol, target netip.AddrPort) (Answer, error) {
	return request(ctx, proto, target, peerChecked(h.Node.NS.DialContext))
}

// Send runs the load from the node's own network namespace; see Pod.Send.
// The peer of every connection is checked as Open does.
func (h *HostClient) Send(ctx context.Context, l Load) []Record {
	return sendWith(ctx, h.Node.NS, l, peerChecked(dialHere))
}

// FloodUDP is not available from a host process: floods inject frames
// where a client's frames arrive, and a host process's datagrams arrive
// nowhere before the node's own stack.
func (h *HostClient) FloodUDP(netip.AddrPort, int) (FloodResult, error) {
	return FloodResult{}, errors.New("a host-network client cannot flood: its datagrams have no interface to inject at")
}

// HostTarget is one frontend a host client reaches a service port at.
type HostTarget struct {
	// Kind is "ClusterIP", "NodePort" (this node's address), or
	// "ExternalIP" for an external or load-balancer IP.
	Kind string
	Addr netip.AddrPort
}

// HostLanding is where a host client's requests to one frontend landed.
type HostLanding struct {
	Target HostTarget
	Landing
}

// MeasureHost sends requests, each on a new flow, from the named node's
// own network namespace to every frontend of every port of service: its
// cluster IP, the node's NodePort, and its external and load-balancer
// IPs. Each landing is held to the node's decision: the internal set for
// the cluster IP, the cluster set for external addresses (in-cluster
// traffic to an external address takes it, in kube-proxy and topolb
// alike). Sources are not checked: local and remote backends see
// different node addresses.
func (tb *traffic) MeasureHost(ctx context.Context, node, service string, o MeasureOptions) ([]HostLanding, error) {
	h := tb.Host(node)
	if h == nil {
		return nil, fmt.Errorf("no node %q", node)
	}
	o = o.withDefaults()
	objs, _ := tb.Current()
	ds, _ := tb.Decide(objs, node)
	var out []HostLanding
	for _, d := range ds {
		if !o.measures(d, service) {
			continue
		}
		targets := []HostTarget{{Kind: "ClusterIP", Addr: d.Frontend}}
		for _, e := range d.External {
			kind := "ExternalIP"
			if e == d.NodePort {
				kind = "NodePort"
			}
			targets = append(targets, HostTarget{Kind: kind, Addr: e})
		}
		for _, tg := range targets {
			dec := d
			if tg.Kind != "ClusterIP" {
				dec.Addrs = slices.Clone(d.ClusterAddrs)
				dec.Backends = tb.PodNames(dec.Addrs)
				slices.Sort(dec.Backends)
			}
			recs := h.Send(ctx, Load{Proto: d.Protocol, Target: tg.Addr, Count: o.Requests, Parallel: o.Parallel, Timeout: o.Timeout})
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			out = append(out, HostLanding{Target: tg, Landing: Landing{Client: h, Decision: dec, Tally: Summarize(nil, recs)}})
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("service %s has no ports", service)
	}
	slices.SortStableFunc(out, func(a, b HostLanding) int {
		return strings.Compare(string(a.Decision.Protocol), string(b.Decision.Protocol))
	})
	return out, nil
}
