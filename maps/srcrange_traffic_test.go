package maps

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/topolb/topolb/internal/nettest"
)

// TestSourceRangesTraffic: real TCP to a load-balancer IP with source
// ranges, from a pod (tc), the node's own processes (socket hooks) and a
// client outside the node (XDP on the uplink): an allowed source connects
// and is answered, another is dropped (its connect times out; a host
// process gets EPERM at once) and counted per frontend, and a connection
// established before the ranges shut its source out keeps working.
func TestSourceRangesTraffic(t *testing.T) {
	requirePrivileges(t)
	tb := newTestbed(t)
	d := hostDatapath(t, tb.node1)
	tb.b1.ServeHTTPName(t, ":8080", "b1")
	const lbIP = "192.0.2.40:80"
	internal := fe(lbIP, TCP)
	external := Frontend{Addr: internal.Addr, Proto: TCP, Scope: ScopeExternal}
	backend := Backend{Addr: netip.MustParseAddrPort("10.1.1.2:8080"), NodeLocal: true}
	set := func(f Frontend, node bool, ranges ...string) {
		t.Helper()
		var ps []netip.Prefix
		for _, r := range ranges {
			ps = append(ps, netip.MustParsePrefix(r))
		}
		mustSetService(t, d, f, Service{Backends: []Backend{backend}, SourceRanges: ps, SourceRangesNode: node})
	}
	for _, ifname := range []string{"hc", "hb1", "hb2"} {
		must(t, d.AttachPod(ifname))
	}
	must(t, d.AttachUplink("w1"))
	must(t, tb.node2.AddRoute("192.0.2.0/24", "10.9.0.1"))
	xdpPassOn(t, tb.node2, "w2")

	get := func(ns *nettest.NS, timeout time.Duration) (string, error) {
		ctx, cancel := context.WithTimeout(t.Context(), timeout)
		defer cancel()
		c, err := ns.DialContext(ctx, "tcp4", lbIP)
		if err != nil {
			return "", err
		}
		defer c.Close()
		return request(c)
	}
	const dropWait = 500 * time.Millisecond
	for _, c := range []struct {
		name string
		ns   *nettest.NS
		fe   Frontend
		// allow and deny are ranges that hold the client and that do not.
		allow, deny string
		// node sets SourceRangesNode with allow: host processes only.
		node bool
	}{
		{"pod", tb.client, internal, "10.1.0.0/24", "10.1.1.0/24", false},
		{"outside_client", tb.node2, external, "10.9.0.2/32", "203.0.113.0/24", false},
		{"host_process", tb.node1, internal, "10.9.0.0/24", "10.9.0.0/24", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			set(c.fe, c.node, c.allow)
			if got, err := get(c.ns, 5*time.Second); err != nil || got != "b1" {
				t.Fatalf("inside the ranges: %q, %v; want b1's answer", got, err)
			}
			before, err := d.SourceRangeDrops()
			must(t, err)
			set(c.fe, false, c.deny)
			_, err = get(c.ns, dropWait)
			switch {
			case c.node && !errors.Is(err, syscall.EPERM):
				t.Errorf("host process outside the ranges: %v, want EPERM", err)
			case !c.node && !errors.Is(err, context.DeadlineExceeded) && !isTimeout(err):
				t.Errorf("outside the ranges: %v, want the connect to time out (dropped)", err)
			}
			after, err := d.SourceRangeDrops()
			must(t, err)
			if n := after[c.fe] - before[c.fe]; n == 0 {
				t.Errorf("no drop counted for %s: %v", c.fe, after)
			}
		})
	}

	// An established connection outlives the ranges that shut its source
	// out.
	set(external, false, "10.9.0.0/24")
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	conn, err := tb.node2.DialContext(ctx, "tcp4", lbIP)
	if err != nil {
		t.Fatalf("connect before the change: %v", err)
	}
	defer conn.Close()
	set(external, false, "203.0.113.0/24")
	if got, err := request(conn); err != nil || got != "b1" {
		t.Errorf("established connection after the ranges changed: %q, %v; want b1's answer", got, err)
	}
	if _, err := get(tb.node2, dropWait); err == nil {
		t.Error("a new connection from the same client got through after the change")
	}
}

// request sends an HTTP/1.0 GET on c and returns the body.
func request(c net.Conn) (string, error) {
	if err := c.SetDeadline(time.Now().Add(5 * time.Second)); err != nil {
		return "", err
	}
	if _, err := fmt.Fprintf(c, "GET / HTTP/1.0\r\nHost: x\r\n\r\n"); err != nil {
		return "", err
	}
	body, err := io.ReadAll(c)
	if err != nil {
		return "", err
	}
	_, name, _ := strings.Cut(string(body), "\r\n\r\n")
	return name, nil
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
