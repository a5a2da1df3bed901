package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/topolb/topolb/internal/nettest"
	"github.com/topolb/topolb/internal/testutil"
	dpmaps "github.com/topolb/topolb/maps"
)

// mapsTestbed is a node with a client pod and a backend pod, tc on both
// veths, and a datapath pinned in a private bpffs: a client connection to
// the Service stays open while the datapath's owner has gone, as after an
// agent stopped.
type mapsTestbed struct {
	pinPath string
	client  *nettest.NS
}

const (
	mapsVIP      = "10.96.0.10:80"
	mapsBackend  = "10.1.1.2:8080"
	mapsDraining = "10.1.1.9:8080"
	mapsService  = "default/web:http"
)

var must = testutil.Must

func newMapsTestbed(t *testing.T) *mapsTestbed {
	t.Helper()
	nettest.RequireRoot(t)
	if err := nettest.RemoveStale(); err != nil {
		t.Logf("removing stale namespaces: %v", err)
	}
	dir := nettest.BPFFS(t)
	node, client, backend := nettest.NewNS(t, "ctl-node"), nettest.NewNS(t, "ctl-client"), nettest.NewNS(t, "ctl-backend")
	must(t, node.Sysctl("net.ipv4.ip_forward", "1"))
	must(t, node.Sysctl("net.ipv4.conf.all.rp_filter", "0"))
	for _, p := range []struct {
		ns           *nettest.NS
		host, subnet string
	}{{client, "hc", "10.1.0"}, {backend, "hb", "10.1.1"}} {
		must(t, nettest.Veth(node, p.host, p.ns, "eth0"))
		must(t, node.AddAddr(p.host, p.subnet+".1/24"))
		must(t, p.ns.AddAddr("eth0", p.subnet+".2/24"))
		must(t, p.ns.AddRoute("default", p.subnet+".1"))
	}
	backend.ServeHTTPName(t, mapsBackend, "web")
	tb := &mapsTestbed{pinPath: filepath.Join(dir, "topolb"), client: client}
	d, err := dpmaps.Load(dpmaps.Options{PinPath: tb.pinPath, NetNS: node.Path, MaxFrontends: 64, MaxBackends: 256, MaxConntrack: 1024})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	must(t, d.AttachPod("hc"))
	must(t, d.AttachPod("hb"))
	web := dpmaps.Frontend{Addr: netip.MustParseAddrPort(mapsVIP), Proto: dpmaps.TCP}
	_, err = d.SetService(web, dpmaps.Service{Name: mapsService, Backends: []dpmaps.Backend{
		{Addr: netip.MustParseAddrPort(mapsBackend), NodeLocal: true}, {Addr: netip.MustParseAddrPort(mapsDraining)}}})
	must(t, err)
	_, err = d.SetService(web, dpmaps.Service{Name: mapsService, Backends: []dpmaps.Backend{
		{Addr: netip.MustParseAddrPort(mapsBackend), NodeLocal: true}, {Addr: netip.MustParseAddrPort(mapsDraining), Draining: true}}})
	must(t, err)
	return tb
}

// connect opens a connection from the client to the Service, completes a
// request on it and leaves it open (closed in t.Cleanup).
func (tb *mapsTestbed) connect(t *testing.T) netip.AddrPort {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := tb.client.DialContext(ctx, "tcp4", mapsVIP)
	if err != nil {
		t.Fatalf("connect to the Service: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	must(t, c.SetDeadline(time.Now().Add(5*time.Second)))
	if _, err := fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: web\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("read the answer: %v", err)
	}
	resp.Body.Close()
	return netip.MustParseAddrPort(c.LocalAddr().String())
}

// ctl runs topolbctl and returns its output, failing t unless it exits
// with want.
func ctl(t *testing.T, want int, args ...string) string {
	t.Helper()
	var out, errOut strings.Builder
	if code := run(args, &out, &errOut); code != want {
		t.Fatalf("topolbctl %s: exit %d, want %d; stderr: %s", strings.Join(args, " "), code, want, errOut.String())
	}
	return out.String() + errOut.String()
}

// TestMapsReadout reads the maps of a datapath whose owner has closed it
// (no agent runs; the pins and a client's connection stay) with every
// `topolbctl maps` subcommand, as tables and JSON, with filters.
func TestMapsReadout(t *testing.T) {
	tb := newMapsTestbed(t)
	client := tb.connect(t)
	dir := "--bpffs=" + tb.pinPath

	t.Run("frontends", func(t *testing.T) {
		var fes []pinnedFrontend
		must(t, json.Unmarshal([]byte(ctl(t, 0, "maps", "frontends", dir, "-o", "json")), &fes))
		if len(fes) != 1 || fes[0].Frontend != mapsVIP+"/TCP" || fes[0].Service != mapsService || fes[0].Slots != 1 ||
			strings.Join(fes[0].Backends, ",") != mapsBackend || strings.Join(fes[0].DrainingBackends, ",") != mapsDraining {
			t.Errorf("frontends: %+v", fes)
		}
		if out := ctl(t, 0, "maps", "frontends", dir); !strings.Contains(out, mapsService) || !strings.Contains(out, "FRONTEND") {
			t.Errorf("the frontends table does not name the service:\n%s", out)
		}
	})

	t.Run("backends", func(t *testing.T) {
		var bs []pinnedBackend
		must(t, json.Unmarshal([]byte(ctl(t, 0, "maps", "backends", dir, "-o", "json")), &bs))
		if len(bs) != 2 || bs[0].Backend != mapsBackend || bs[0].State != "active" || bs[0].Weight != 1 || !bs[0].NodeLocal || bs[0].Flows != 1 ||
			bs[1].Backend != mapsDraining || bs[1].State != "draining" || bs[1].Weight != 0 {
			t.Errorf("backends: %+v", bs)
		}
		must(t, json.Unmarshal([]byte(ctl(t, 0, "maps", "backends", dir, "--state", "draining", "-o", "json")), &bs))
		if len(bs) != 1 || bs[0].Backend != mapsDraining {
			t.Errorf("backends --state draining: %+v", bs)
		}
	})

	t.Run("conntrack", func(t *testing.T) {
		var rows []conntrackRow
		must(t, json.Unmarshal([]byte(ctl(t, 0, "maps", "conntrack", dir, "--state", "established", "--service", "default/web", "-o", "json")), &rows))
		var fwd, rev *conntrackRow
		for i, r := range rows {
			switch {
			case r.Direction == "forward" && r.Src == client.String():
				fwd = &rows[i]
			case r.Direction == "reverse" && r.Dst == client.String():
				rev = &rows[i]
			}
		}
		if len(rows) != 2 || fwd == nil || rev == nil {
			t.Fatalf("want the connection's two established entries from %s, got %+v", client, rows)
		}
		if fwd.Table != "established" || fwd.Dst != mapsVIP || fwd.NewSrc != client.String() || fwd.NewDst != mapsBackend ||
			fwd.Backend != mapsBackend || fwd.BackendGone || fwd.Service != mapsService || fwd.Frontend != mapsVIP+"/TCP" ||
			fwd.ExpiresSeconds <= dpmaps.TimeoutTCPEstablished.Seconds()-60 || fwd.ExpiresSeconds > dpmaps.TimeoutTCPEstablished.Seconds() {
			t.Errorf("forward entry: %+v", *fwd)
		}
		if rev.Src != mapsBackend || rev.NewSrc != mapsVIP || rev.NewDst != client.String() || rev.Backend != mapsBackend {
			t.Errorf("reverse entry: %+v", *rev)
		}
		out := ctl(t, 0, "maps", "conntrack", dir, "--address", "10.1.0.0/24", "--port", fmt.Sprint(client.Port()))
		if !strings.Contains(out, client.String()+" > "+mapsVIP) || !strings.Contains(out, mapsVIP+" > "+client.String()) {
			t.Errorf("the conntrack table filtered to the client's address and port misses its entries:\n%s", out)
		}
		if out := ctl(t, 0, "maps", "conntrack", dir, "--address", "10.9.9.9"); strings.TrimSpace(out) != "no entries" {
			t.Errorf("an address no entry has: %q, want no entries", out)
		}
		if out := ctl(t, 0, "maps", "conntrack", dir, "--protocol", "udp"); strings.TrimSpace(out) != "no entries" {
			t.Errorf("UDP only: %q, want no entries", out)
		}
	})

	t.Run("snat_and_affinity_empty", func(t *testing.T) {
		var rows []snatRow
		must(t, json.Unmarshal([]byte(ctl(t, 0, "maps", "snat", dir, "-o", "json")), &rows))
		if len(rows) != 0 {
			t.Errorf("SNAT ports without traffic from outside: %+v", rows)
		}
		var aff []affinityRow
		must(t, json.Unmarshal([]byte(ctl(t, 0, "maps", "affinity", dir, "-o", "json")), &aff))
		if len(aff) != 0 {
			t.Errorf("affinity entries without affinity: %+v", aff)
		}
	})

	t.Run("stats", func(t *testing.T) {
		var st []statRow
		must(t, json.Unmarshal([]byte(ctl(t, 0, "maps", "stats", dir, "-o", "yaml", "-o", "json")), &st))
		got := map[string]uint64{}
		for _, r := range st {
			got[r.Counter] = r.Value
		}
		if got["conntrack_created"] != 1 || got["conntrack_promoted"] == 0 {
			t.Errorf("counters after one connection: created %d, promoted %d (of %d counters)", got["conntrack_created"], got["conntrack_promoted"], len(st))
		}
	})

	t.Run("bad_input", func(t *testing.T) {
		for _, args := range [][]string{
			{"maps", "conntrack", dir, "--protocol", "sctp"},
			{"maps", "conntrack", dir, "--address", "10.1.0"},
			{"maps", "frontends", dir, "-o", "wide"},
			{"maps", "stats", dir, "--state", "x"},
		} {
			ctl(t, 2, args...)
		}
		if out := ctl(t, 1, "maps", "frontends", "--bpffs", t.TempDir()); !strings.Contains(out, "no topolb datapath pinned") {
			t.Errorf("a directory without maps: %q", out)
		}
	})
}
