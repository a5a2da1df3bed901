package nettest

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"testing"
	"time"
)

// HTTPClient returns a client whose connections start inside the
// namespace, one connection per request (so each request is a new flow).
func (ns *NS) HTTPClient(timeout time.Duration) *http.Client {
	return &http.Client{
		Timeout: timeout,
		Transport: &http.Transport{
			DialContext:       ns.DialContext,
			DisableKeepAlives: true,
		},
	}
}

// ServeHTTPName serves HTTP on addr inside the namespace, answering every
// request with name. Stopped in t.Cleanup.
func (ns *NS) ServeHTTPName(t testing.TB, addr, name string) {
	t.Helper()
	l, err := ns.Listen(network("tcp", addr), addr)
	if err != nil {
		t.Fatalf("%s: listen tcp %s: %v", ns.Name, addr, err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, name)
	})}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("%s: serve http: %v", ns.Name, err)
		}
	}()
	t.Cleanup(func() {
		srv.Close()
		<-done
	})
}

// ServeUDPName answers every datagram arriving on addr inside the
// namespace with name. Stopped in t.Cleanup.
func (ns *NS) ServeUDPName(t testing.TB, addr, name string) {
	t.Helper()
	ns.ServeUDP(t, addr, func([]byte) []byte { return []byte(name) })
}

// ServeUDP answers every datagram arriving on addr inside the namespace
// (up to 64 KiB, fragmented or not) with what answer returns for it;
// nothing when it returns nil. Stopped in t.Cleanup.
func (ns *NS) ServeUDP(t testing.TB, addr string, answer func(req []byte) []byte) {
	t.Helper()
	c, err := ns.ListenPacket(network("udp", addr), addr)
	if err != nil {
		t.Fatalf("%s: listen udp %s: %v", ns.Name, addr, err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 1<<16)
		for {
			n, from, err := c.ReadFrom(buf)
			if err != nil {
				return // closed
			}
			if out := answer(buf[:n]); out != nil {
				c.WriteTo(out, from)
			}
		}
	}()
	t.Cleanup(func() {
		c.Close()
		<-done
	})
}

// network is proto's network for the listening address addr: IPv6 when
// its host is an IPv6 address, else IPv4 (":8080" listens on IPv4 only,
// as the servers always did).
func network(proto, addr string) string {
	host, _, err := net.SplitHostPort(addr)
	if a, perr := netip.ParseAddr(host); err == nil && perr == nil && a.Is6() && !a.Is4In6() {
		return proto + "6"
	}
	return proto + "4"
}
