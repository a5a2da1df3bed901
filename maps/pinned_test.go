package maps

import (
	"errors"
	"net/netip"
	"os"
	"testing"
	"time"
)

// TestPinnedReadout programs a datapath, sends real packets through its
// programs (source-translated flows through XDP, a pod's flow to an
// affinity frontend through tc), stops it as an agent stops (Close: the
// pins stay), and reads everything back with OpenPinned: names, backends
// with state and weight, both conntrack tables with both address pairs,
// SNAT ports, affinity and counters.
func TestPinnedReadout(t *testing.T) {
	e := newFwdEnv(t, Options{})
	d := e.d
	sf := newSNATFlows(t, e)
	runTable(t, d, sf.rows(e, hookXDP, xdpTX, xdpRedirect))

	remote := Service{Backends: []Backend{be(ap(beNode2, 8080))}, Name: "default/remote:http"}
	if n := mustSetService(t, d, sf.feRemote, remote); n != 1 {
		t.Errorf("naming a programmed frontend took %d writes, want 1 (the name)", n)
	}
	if n := mustSetService(t, d, sf.feRemote, remote); n != 0 {
		t.Errorf("the same service and name again took %d writes, want 0", n)
	}
	sticky := fe(vipTCP, TCP)
	a, b := be("10.1.0.1:8080"), be("10.1.0.2:8080")
	mustSetService(t, d, sticky, Service{Backends: []Backend{a, b}, Affinity: time.Hour, Name: "default/sticky"})
	client := "10.0.0.40:1000"
	if ret, _ := run(t, d.tcProg, tcpFrame(client, vipTCP, tcpSYN, "").bytes()); ret == tcShot {
		t.Fatal("the SYN to the affinity frontend was dropped")
	}
	chosen := netip.MustParseAddrPort(backendAt(t, d, sticky, slotOf(netip.MustParseAddrPort(client), sticky.Addr, protoTCP, 2)))
	other := a
	if other.Addr == chosen {
		other = b
	}
	other.Draining = true
	mustSetService(t, d, sticky, Service{Backends: []Backend{{Addr: chosen}, other}, Affinity: time.Hour, Name: "default/sticky"})
	pinPath := d.opts.PinPath
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}

	p, err := OpenPinned(pinPath)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()

	t.Run("frontends", func(t *testing.T) {
		fes, err := p.Frontends()
		if err != nil {
			t.Fatal(err)
		}
		byFE := map[Frontend]PinnedFrontend{}
		for _, f := range fes {
			byFE[f.Frontend] = f
		}
		if len(byFE) != 4 {
			t.Fatalf("%d frontends read, want 4: %+v", len(byFE), fes)
		}
		if got := byFE[sf.feRemote]; got.Name != "default/remote:http" || len(got.Backends) != 1 || got.Backends[0].Addr.String() != ap(beNode2, 8080) ||
			got.Backends[0].State != "active" || !got.Backends[0].Current || got.Backends[0].Weight != 1 {
			t.Errorf("feRemote read as %+v", got)
		}
		if got := byFE[sf.feCluster]; got.Name != "" || len(got.Backends) != 2 {
			t.Errorf("feCluster (no name given) read as %+v", got)
		}
		got := byFE[sticky]
		if got.Name != "default/sticky" || got.Affinity != time.Hour || len(got.Backends) != 2 {
			t.Fatalf("the affinity frontend read as %+v", got)
		}
		if act, dr := got.Backends[0], got.Backends[1]; act.Addr != chosen || act.State != "active" || act.Weight != 1 || act.Traffic.Flows != 1 ||
			dr.Addr != other.Addr || dr.State != "draining" || dr.Weight != 0 || !dr.Draining {
			t.Errorf("the affinity frontend's backends read as %+v, want %s active with its one flow and %s draining", got.Backends, chosen, other.Addr)
		}
	})

	entries, err := p.Conntrack()
	if err != nil {
		t.Fatal(err)
	}
	t.Run("conntrack", func(t *testing.T) {
		find := func(src, dst string) ConntrackEntry {
			t.Helper()
			for _, e := range entries {
				if e.Src.String() == src && e.Dst.String() == dst {
					return e
				}
			}
			t.Fatalf("no entry %s -> %s in %+v", src, dst, entries)
			return ConntrackEntry{}
		}
		fwd := find(sf.cToNode2, sf.feCluster.Addr.String())
		if fwd.Table != "established" || fwd.Direction != "forward" || fwd.State != "established" || !fwd.SNAT ||
			fwd.NewSrc.String() != sf.snatSrc || fwd.NewDst.String() != ap(beNode2, 8080) || fwd.Backend.Addr.String() != ap(beNode2, 8080) ||
			!fwd.Backend.Current || fwd.Frontend != sf.feCluster || fwd.Redirect != "xdp" ||
			fwd.Expires <= TimeoutTCPEstablished-time.Minute || fwd.Expires > TimeoutTCPEstablished {
			t.Errorf("the source-translated flow's forward entry read as %+v", fwd)
		}
		rev := find(ap(beNode2, 8080), sf.snatSrc)
		if rev.Table != "established" || rev.Direction != "reverse" || !rev.SNAT || rev.NewSrc != sf.feCluster.Addr ||
			rev.NewDst.String() != sf.cToNode2 || rev.Backend.Addr.String() != ap(beNode2, 8080) {
			t.Errorf("its reverse entry read as %+v", rev)
		}
		pod := find(client, vipTCP)
		if pod.Table != "unreplied" || pod.State != "syn_sent" || pod.SNAT || pod.NewSrc.String() != client || pod.NewDst != chosen ||
			pod.Name != "default/sticky" || !pod.Backend.Current || pod.Expires <= 0 || pod.Expires > TimeoutTCPSyn {
			t.Errorf("the pod's flow read as %+v", pod)
		}
	})

	t.Run("snat", func(t *testing.T) {
		ports := SNATPorts(entries)
		want := map[string]string{ // node address:port -> client
			sf.snatSrc:                    sf.cToNode2,
			ap(nodeAddr, int(sf.udpPort)): sf.cUDP,
			ap(nodeAddr, int(sf.up1Port)): sf.cUp1,
		}
		if len(ports) != len(want) {
			t.Fatalf("%d SNAT ports, want %d: %+v", len(ports), len(want), ports)
		}
		for _, sp := range ports {
			if want[sp.Node.String()] != sp.Client.String() || sp.Backend.Addr().String() != beNode2 {
				t.Errorf("SNAT port %+v not expected (want node port -> client %v, towards %s)", sp, want, beNode2)
			}
		}
	})

	t.Run("affinity", func(t *testing.T) {
		aff, err := p.Affinity()
		if err != nil {
			t.Fatal(err)
		}
		if len(aff) != 1 {
			t.Fatalf("%d affinity entries, want 1: %+v", len(aff), aff)
		}
		if got := aff[0]; got.Client.String() != "10.0.0.40" || got.Frontend != sticky || got.Name != "default/sticky" ||
			got.Backend.Addr != chosen || !got.Backend.Current || got.Expires <= time.Hour-time.Minute || got.Expires > time.Hour {
			t.Errorf("affinity entry read as %+v, want client 10.0.0.40 on %s for about an hour", got, chosen)
		}
	})

	t.Run("stats", func(t *testing.T) {
		st, err := p.Stats()
		if err != nil {
			t.Fatal(err)
		}
		if st[StatSNATFlows] != 3 || st[StatConntrackCreated] != 4 || st[StatAffinityNew] != 1 {
			t.Errorf("counters: snat flows %d (want 3), flows created %d (want 4), affinity new %d (want 1)",
				st[StatSNATFlows], st[StatConntrackCreated], st[StatAffinityNew])
		}
	})

	t.Run("names_survive_a_restart", func(t *testing.T) {
		d2, err := Load(Options{PinPath: pinPath, MaxFrontends: 1024, MaxBackends: 4096, MaxConntrack: 4096, NetNS: e.node.Path})
		if err != nil {
			t.Fatal(err)
		}
		defer d2.Close()
		if got := d2.Services()[sf.feRemote].Name; got != "default/remote:http" {
			t.Errorf("adopted name %q", got)
		}
		// Beside a running owner, which holds the directory's lock.
		beside, err := OpenPinned(pinPath)
		if err != nil {
			t.Fatalf("OpenPinned beside a running datapath: %v", err)
		}
		fes, err := beside.Frontends()
		beside.Close()
		if err != nil || len(fes) != 4 {
			t.Errorf("beside a running datapath: %d frontends, %v; want 4", len(fes), err)
		}
		if n := mustSetService(t, d2, sf.feRemote, remote); n != 0 {
			t.Errorf("the same service and name after a restart took %d writes, want 0", n)
		}
		if _, err := d2.DeleteFrontend(sf.feRemote); err != nil {
			t.Fatal(err)
		}
		names, err := readNames(d2.names)
		if err != nil {
			t.Fatal(err)
		}
		stickyKey, err := svcKey(sticky)
		if err != nil {
			t.Fatal(err)
		}
		if len(names) != 1 || names[stickyKey] != "default/sticky" {
			t.Errorf("names after deleting feRemote: %v, want only default/sticky", names)
		}
	})
}

// TestPinnedRefusesWhatIsNotADatapath checks that OpenPinned on a
// directory without maps says so.
func TestPinnedRefusesWhatIsNotADatapath(t *testing.T) {
	_, err := OpenPinned(bpffs(t))
	if !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("OpenPinned on an empty bpffs: %v, want an error wrapping os.ErrNotExist", err)
	}
}

// TestServiceNameBounds checks that a name too long or with a NUL is
// refused before anything is written.
func TestServiceNameBounds(t *testing.T) {
	d := newDatapath(t, Options{})
	f := fe(vipTCP, TCP)
	long := string(make([]byte, MaxNameLen+1))
	for _, name := range []string{long[:MaxNameLen+1], "a\x00b"} {
		n, err := d.SetService(f, Service{Backends: []Backend{be("10.1.0.1:80")}, Name: name})
		if err == nil || n != 0 {
			t.Errorf("name of %d bytes: %d writes, err %v; want 0 writes and an error", len(name), n, err)
		}
	}
	fill := make([]byte, MaxNameLen)
	for i := range fill {
		fill[i] = 'x'
	}
	if _, err := d.SetService(f, Service{Backends: []Backend{be("10.1.0.1:80")}, Name: string(fill)}); err != nil {
		t.Errorf("a name of MaxNameLen bytes: %v", err)
	}
	if got := d.Services()[f].Name; got != string(fill) {
		t.Errorf("name read back %q", got)
	}
}

// TestPinnedConntrackIPv6: OpenPinned reads the IPv6 conntrack tables as
// IPv4's, after them: a pod's flow through tc and a planted
// source-translated flow, both directions with both address pairs, and
// the SNAT port it holds.
func TestPinnedConntrackIPv6(t *testing.T) {
	a := tcFamilies[1].addrs
	d := setupTableFor(t, a)
	if ret, _ := run(t, d.tcProg, tcpFrame(a.client, a.vipTCP, tcpSYN, "").bytes()); ret != tcOK {
		t.Fatalf("SYN: verdict %d", ret)
	}
	client, vip, backend, nat := "[2001:db8:113::1]:5000", "[fd00:250::1]:30080", "[fd00:244:2::10]:8080", "[fd00:250::1]:61000"
	plantSNATFlow(client, vip, backend, nat, protoTCP)(t, d)
	pinPath := d.opts.PinPath
	must(t, d.Close())
	p, err := OpenPinned(pinPath)
	must(t, err)
	defer p.Close()
	entries, err := p.Conntrack()
	must(t, err)
	type pair struct{ src, dst, newSrc, newDst, table, dir string }
	got := map[pair]bool{}
	for _, e := range entries {
		got[pair{e.Src.String(), e.Dst.String(), e.NewSrc.String(), e.NewDst.String(), e.Table, e.Direction}] = true
	}
	for _, w := range []pair{
		{a.client, a.vipTCP, a.client, a.beTCP, "unreplied", "forward"},
		{a.beTCP, a.client, a.vipTCP, a.client, "unreplied", "reverse"},
		{client, vip, nat, backend, "established", "forward"},
		{backend, nat, vip, client, "established", "reverse"},
	} {
		if !got[w] {
			t.Errorf("no entry %+v among %+v", w, entries)
		}
	}
	if len(entries) != 4 {
		t.Errorf("%d entries, want 4: %+v", len(entries), entries)
	}
	ports := SNATPorts(entries)
	if len(ports) != 1 || ports[0].Node.String() != nat || ports[0].Backend.String() != backend || ports[0].Client.String() != client {
		t.Errorf("SNAT ports %+v, want %s held towards %s for %s", ports, nat, backend, client)
	}
}
