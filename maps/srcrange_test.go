package maps

import (
	"maps"
	"net/netip"
	"path/filepath"
	"slices"
	"testing"
)

// TestSourceRanges runs new flows and established ones through tc (pods)
// and XDP (uplinks) to load-balancer frontends with source ranges: sources
// inside pass, others are dropped and counted (tlb_stats and per
// frontend), a frontend without ranges is untouched, a change of the
// ranges never cuts an established flow, and removing the ranges lets
// everyone in.
func TestSourceRanges(t *testing.T) {
	d := newDatapath(t, Options{})
	lbInt := fe("192.0.2.30:80", TCP)
	lbExt := Frontend{Addr: lbInt.Addr, Proto: TCP, Scope: ScopeExternal}
	open := fe("192.0.2.31:80", TCP)
	backend := Backend{Addr: netip.MustParseAddrPort("10.1.0.1:8080"), NodeLocal: true}
	pods := []netip.Prefix{netip.MustParsePrefix("10.0.0.2/32")}
	outside := []netip.Prefix{netip.MustParsePrefix("203.0.113.0/24"), netip.MustParsePrefix("198.18.0.0/15")}
	mustSetService(t, d, lbInt, Service{Backends: []Backend{backend}, SourceRanges: pods})
	mustSetService(t, d, lbExt, Service{Backends: []Backend{backend}, SourceRanges: outside})
	mustSetService(t, d, open, Service{Backends: []Backend{backend}})
	prog, err := d.Programmed()
	must(t, err)
	if got := prog[lbExt].SourceRanges; !slices.Equal(got, []netip.Prefix{outside[1], outside[0]}) || prog[open].SourceRanges != nil {
		t.Errorf("read back: %v for %s (want %v sorted), %v for %s (want nil)", got, lbExt, outside, prog[open].SourceRanges, open)
	}

	type row struct {
		name    string
		hook    hook
		in      frame
		dropped bool
		// stats are the expected counter deltas.
		stats stats
	}
	runRows := func(t *testing.T, rows []row) {
		t.Helper()
		for _, c := range rows {
			t.Run(c.name, func(t *testing.T) {
				prog, dropV := d.tcProg, uint32(tcShot)
				if c.hook == hookXDP {
					prog, dropV = d.xdpProg, xdpDrop
				}
				before, err := d.Counters()
				must(t, err)
				ret, _ := run(t, prog, c.in.bytes())
				after, err := d.Counters()
				must(t, err)
				if (ret == dropV) != c.dropped {
					t.Errorf("verdict %d, dropped %v, want dropped %v", ret, ret == dropV, c.dropped)
				}
				for s := Stat(0); int(s) < numStats; s++ {
					if s == StatFwdStack || s == StatFwdNeigh || s == StatFwdPeer || s == StatFwdL2 {
						continue // where the test run's packets go is forward_test.go's
					}
					if got := after.Stats[s] - before.Stats[s]; got != c.stats[s] {
						t.Errorf("%s delta = %d, want %d", s, got, c.stats[s])
					}
				}
			})
		}
	}
	created, refused := stats{StatConntrackCreated: 1}, stats{StatDropSourceRange: 1}
	runRows(t, []row{
		{"tc_pod_inside_the_range", hookTC, tcpFrame(client, lbInt.Addr.String(), tcpSYN, ""), false, created},
		{"tc_pod_outside_the_range", hookTC, tcpFrame(client3, lbInt.Addr.String(), tcpSYN, ""), true, refused},
		{"tc_frontend_without_ranges", hookTC, tcpFrame(client3, open.Addr.String(), tcpSYN, ""), false, created},
		{"xdp_outside_client_inside_a_range", hookXDP, tcpFrame(northClient, lbExt.Addr.String(), tcpSYN, ""), false, created},
		{"xdp_second_range", hookXDP, tcpFrame("198.19.255.1:5000", lbExt.Addr.String(), tcpSYN, ""), false, created},
		{"xdp_outside_every_range", hookXDP, tcpFrame("198.51.100.7:5000", lbExt.Addr.String(), tcpSYN, ""), true, refused},
		{"xdp_udp_to_the_tcp_frontend_is_not_ours", hookXDP, udpFrame("198.51.100.7:5000", lbExt.Addr.String(), "q"), false, nil},
	})
	drops, err := d.SourceRangeDrops()
	must(t, err)
	if drops[lbInt] != 1 || drops[lbExt] != 1 || len(drops) != 2 {
		t.Errorf("per-frontend drops %v, want 1 for each frontend with ranges", drops)
	}
	if c, err := d.Counters(); err != nil || !maps.Equal(c.SourceRangeDrops, drops) {
		t.Errorf("Counters().SourceRangeDrops = %v, %v; want %v", c.SourceRangeDrops, err, drops)
	}

	// The ranges change to exclude client: its established flow goes on,
	// its new flows are refused, client3's are let in.
	mustSetService(t, d, lbInt, Service{Backends: []Backend{backend}, SourceRanges: []netip.Prefix{netip.MustParsePrefix("10.0.0.3/32")}})
	runRows(t, []row{
		{"tc_established_flow_survives_the_change", hookTC, tcpFrame(client, lbInt.Addr.String(), tcpACK, "more"), false, nil},
		{"tc_new_flow_of_the_excluded_source", hookTC, tcpFrame(client2, lbInt.Addr.String(), tcpSYN, ""), true, refused},
		{"tc_new_flow_of_the_included_source", hookTC, tcpFrame("10.0.0.3:40009", lbInt.Addr.String(), tcpSYN, ""), false, created},
	})
	if got := rangesHeld(t, d); got != 1+len(outside) {
		t.Errorf("tlb_src_ranges holds %d prefixes, want %d (the old one deleted)", got, 1+len(outside))
	}

	// Without ranges everyone passes and the prefixes are gone.
	mustSetService(t, d, lbInt, Service{Backends: []Backend{backend}})
	runRows(t, []row{
		{"tc_no_ranges_any_source", hookTC, tcpFrame("10.0.0.9:40000", lbInt.Addr.String(), tcpSYN, ""), false, created},
	})
	if _, err := d.DeleteFrontend(lbExt); err != nil {
		t.Fatal(err)
	}
	if got := rangesHeld(t, d); got != 0 {
		t.Errorf("tlb_src_ranges holds %d prefixes after the frontends lost them, want 0", got)
	}

	// Bad prefixes are refused and change nothing.
	for _, bad := range []netip.Prefix{netip.MustParsePrefix("10.0.0.1/24"), netip.MustParsePrefix("2001:db8::/32"), {}} {
		n, err := d.SetService(lbInt, Service{Backends: []Backend{backend}, SourceRanges: []netip.Prefix{bad}})
		if err == nil || n != 0 {
			t.Errorf("source range %v: %d writes, err %v; want an error and no write", bad, n, err)
		}
	}
}

// TestSourceRangesAdopted: an agent restarting on pinned maps adopts the
// prefixes, so a later change deletes the ones no longer wanted.
func TestSourceRangesAdopted(t *testing.T) {
	opts := Options{PinPath: filepath.Join(bpffs(t), "topolb"), MaxFrontends: 64, MaxBackends: 256, MaxConntrack: 1024}
	lb := Frontend{Addr: netip.MustParseAddrPort("192.0.2.30:80"), Proto: TCP, Scope: ScopeExternal}
	backend := Backend{Addr: netip.MustParseAddrPort("10.1.0.1:8080"), NodeLocal: true}
	first := newDatapath(t, opts)
	mustSetService(t, first, lb, Service{Backends: []Backend{backend},
		SourceRanges: []netip.Prefix{netip.MustParsePrefix("203.0.113.0/24"), netip.MustParsePrefix("198.51.100.0/24")}})
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	second, err := Load(opts)
	if err != nil {
		t.Fatalf("reload: %v", err)
	}
	t.Cleanup(func() { second.Close() })
	if got := rangesHeld(t, second); got != 2 {
		t.Fatalf("after adoption tlb_src_ranges holds %d prefixes, want 2", got)
	}
	mustSetService(t, second, lb, Service{Backends: []Backend{backend}, SourceRanges: []netip.Prefix{netip.MustParsePrefix("203.0.113.0/24")}})
	if got := rangesHeld(t, second); got != 1 {
		t.Errorf("after a change tlb_src_ranges holds %d prefixes, want 1 (the adopted one no longer wanted deleted)", got)
	}
	ret, _ := run(t, second.xdpProg, tcpFrame("198.51.100.7:5000", lb.Addr.String(), tcpSYN, "").bytes())
	if ret != xdpDrop {
		t.Errorf("a source of the deleted range: verdict %d, want drop", ret)
	}
}

// rangesHeld counts the kernel's tlb_src_ranges entries.
func rangesHeld(t *testing.T, d *Datapath) int {
	t.Helper()
	return countEntries[tcSrcRangeKey, uint8](t, d.srcRanges)
}

// TestSourceRangesRepaired: verification finds a prefix missing from
// tlb_src_ranges and one nobody programmed, and repair restores what was
// programmed, which the datapath then enforces again.
func TestSourceRangesRepaired(t *testing.T) {
	d := newDatapath(t, Options{})
	lb := Frontend{Addr: netip.MustParseAddrPort("192.0.2.30:80"), Proto: TCP, Scope: ScopeExternal}
	backend := Backend{Addr: netip.MustParseAddrPort("10.1.0.1:8080"), NodeLocal: true}
	allowed := netip.MustParsePrefix("203.0.113.0/24")
	mustSetService(t, d, lb, Service{Backends: []Backend{backend}, SourceRanges: []netip.Prefix{allowed}})
	id := d.fes[lb].id
	must(t, d.srcRanges.Delete(sourceRangeKey(id, allowed)))
	must(t, d.srcRanges.Put(sourceRangeKey(id, netip.MustParsePrefix("198.51.100.0/24")), uint8(1)))
	if ret, _ := run(t, d.xdpProg, tcpFrame("198.51.100.7:5000", lb.Addr.String(), tcpSYN, "").bytes()); ret == xdpDrop {
		t.Fatal("the stray prefix does not let its source in: the corruption did not take")
	}
	found, err := d.Verify()
	must(t, err)
	kinds := 0
	for _, dr := range found {
		if dr.Kind == DriftSourceRange && dr.Frontend == lb {
			kinds++
		}
	}
	if kinds != 2 || len(found) != 2 {
		t.Fatalf("Verify found %v, want the missing and the stray prefix of %s", found, lb)
	}
	rep, err := d.Repair()
	must(t, err)
	if len(rep.Remaining) != 0 || len(rep.Reprogrammed) != 0 {
		t.Errorf("repair left %v, reprogrammed %v; want the prefixes fixed alone", rep.Remaining, rep.Reprogrammed)
	}
	if ret, _ := run(t, d.xdpProg, tcpFrame("198.51.100.7:5001", lb.Addr.String(), tcpSYN, "").bytes()); ret != xdpDrop {
		t.Errorf("after repair the stray prefix's source: verdict %d, want drop", ret)
	}
	if ret, _ := run(t, d.xdpProg, tcpFrame("203.0.113.7:5000", lb.Addr.String(), tcpSYN, "").bytes()); ret == xdpDrop {
		t.Error("after repair the programmed prefix's source is still dropped")
	}
}
