package maps

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"
)

// affinityOf reads the affinity entry of client ip for frontend f.
func affinityOf(t *testing.T, d *Datapath, ip string, f Frontend) (tcAffinityValue, bool) {
	t.Helper()
	k := tcAffinityKey{Client: wireAddr(netip.MustParseAddr(ip)), SvcId: d.fes[f].id}
	var v tcAffinityValue
	if err := d.affinity.Lookup(&k, &v); err != nil {
		return v, false
	}
	return v, true
}

func setAffinityExpires(ip string, f Frontend, offset time.Duration) func(t *testing.T, d *Datapath) {
	return func(t *testing.T, d *Datapath) {
		t.Helper()
		v, ok := affinityOf(t, d, ip, f)
		if !ok {
			t.Fatalf("no affinity entry for %s", ip)
		}
		v.Expires = uint64(int64(nowNS(t)) + int64(offset))
		k := tcAffinityKey{Client: wireAddr(netip.MustParseAddr(ip)), SvcId: d.fes[f].id}
		if err := d.affinity.Update(&k, &v, ebpf.UpdateExist); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSessionAffinity checks ClientIP affinity: new flows of one client go
// to its remembered backend while that backend is active in the set and
// the memory has not expired; otherwise a backend is chosen by hash and
// remembered; never a backend outside the active set.
func TestSessionAffinity(t *testing.T) {
	d := newDatapath(t, Options{})
	f := fe(vipTCP, TCP)
	a, b, c := be("10.1.0.1:8080"), be("10.1.0.2:8080"), be("10.1.0.3:8080")
	svc := func(bs ...Backend) Service { return Service{Backends: bs, Affinity: time.Hour} }
	mustSetService(t, d, f, svc(a, b, c))
	const ip = "10.0.0.40"
	// The first flow hashes to slot 0 (a); later ones would hash
	// elsewhere, so landing on a proves the affinity.
	first := srcFor(t, ip, f, 0, 3, 1000)
	var others []string
	for port := 3000; len(others) < 20; port++ {
		src := fmt.Sprintf("%s:%d", ip, port)
		if slotOf(netip.MustParseAddrPort(src), f.Addr, protoTCP, 3) != 0 {
			others = append(others, src)
		}
	}
	syn := func(src string) frame { return tcpFrame(src, vipTCP, tcpSYN, "") }
	to := func(src, backend string) *frame { return ptr(syn(src).withAddrs("", backend)) }
	hit := newFlowStats(stats{StatAffinityHit: 1})
	fresh := newFlowStats(stats{StatAffinityNew: 1})

	rows := []pktCase{{name: "first_flow_chooses_by_hash", hook: hookTC, in: syn(first), out: to(first, a.Addr.String()), fwd: f, newFlow: true, stats: fresh,
		after: func(t *testing.T, d *Datapath) {
			v, ok := affinityOf(t, d, ip, f)
			want := nowNS(t) + uint64(time.Hour)
			if !ok || v.BackendId != d.fes[f].members[a.Addr].id || v.Expires+clockSlack < want || v.Expires > want+clockSlack {
				t.Errorf("affinity entry %+v (found %t), want a's id expiring in 1h", v, ok)
			}
		}}}
	for i, src := range others[:10] {
		rows = append(rows, pktCase{name: fmt.Sprintf("new_flow_%d_sticks", i), hook: hookTC, in: syn(src), out: to(src, a.Addr.String()), fwd: f, newFlow: true, stats: hit})
	}
	// Expired memory: chosen by hash again (not slot 0), and remembered.
	expired := others[10]
	slot := slotOf(netip.MustParseAddrPort(expired), f.Addr, protoTCP, 3)
	rehashed := backendAt(t, d, f, slot)
	rows = append(rows,
		pktCase{name: "expired_memory_rehashes", before: setAffinityExpires(ip, f, -time.Second), hook: hookTC, in: syn(expired), out: to(expired, rehashed), fwd: f, newFlow: true, stats: fresh},
		pktCase{name: "new_memory_sticks", hook: hookTC, in: syn(others[11]), out: to(others[11], rehashed), fwd: f, newFlow: true, stats: hit},
	)
	runTable(t, d, rows)

	// The remembered backend drains: new flows never go there, and the
	// client gets a new memory among the active ones.
	var activeLeft []Backend
	for _, x := range []Backend{a, b, c} {
		if x.Addr.String() != rehashed {
			activeLeft = append(activeLeft, x)
		}
	}
	mustSetService(t, d, f, svc(append(activeLeft, drained(be(rehashed)))...))
	landed := map[string]int{}
	for _, src := range others[12:] {
		ret, out := run(t, d.tcProg, syn(src).bytes())
		if ret != tcOK {
			t.Fatalf("verdict %d", ret)
		}
		p, err := verifyChecksums(out)
		if err != nil {
			t.Fatal(err)
		}
		landed[p.dst.String()]++
	}
	t.Logf("after draining %s: %v", rehashed, landed)
	if landed[rehashed] != 0 || len(landed) != 1 {
		t.Errorf("flows after draining the remembered backend %s landed on %v: want one active backend only", rehashed, landed)
	}
	var remembered string
	for k := range landed {
		remembered = k
	}
	// Gone: the next choice is among what is left; never the gone one.
	var last []Backend
	for _, x := range activeLeft {
		if x.Addr.String() != remembered {
			last = append(last, x)
		}
	}
	mustSetService(t, d, f, svc(last...))
	for i := 0; i < 5; i++ {
		src := fmt.Sprintf("%s:%d", ip, 9000+i)
		ret, out := run(t, d.tcProg, syn(src).bytes())
		p, err := verifyChecksums(out)
		if ret != tcOK || err != nil {
			t.Fatalf("verdict %d, %v", ret, err)
		}
		if p.dst.String() != last[0].Addr.String() {
			t.Errorf("flow %d after %s was gone went to %s, want %s (the only active backend)", i, remembered, p.dst, last[0].Addr)
		}
	}
	checkConsistent(t, d)
}

// TestSessionAffinityUDP checks affinity for UDP and that it is per
// client and per frontend.
func TestSessionAffinityUDP(t *testing.T) {
	d := newDatapath(t, Options{})
	f := fe(vipUDP, UDP)
	bs := []Backend{be("10.1.0.1:53"), be("10.1.0.2:53"), be("10.1.0.3:53"), be("10.1.0.4:53")}
	mustSetService(t, d, f, Service{Backends: bs, Affinity: DefaultAffinityTimeout})
	other := fe("10.96.0.99:53", UDP)
	mustSet(t, d, other, bs...) // no affinity
	perClient := map[string]map[string]int{}
	noAffinity := map[string]int{}
	for _, ip := range []string{"10.0.1.1", "10.0.1.2", "10.0.1.3", "10.0.1.4", "10.0.1.5", "10.0.1.6"} {
		perClient[ip] = map[string]int{}
		for port := 1000; port < 1100; port++ {
			src := fmt.Sprintf("%s:%d", ip, port)
			for _, target := range []Frontend{f, other} {
				ret, out := run(t, d.tcProg, udpFrame(src, target.Addr.String(), "q").bytes())
				p, err := verifyChecksums(out)
				if ret != tcOK || err != nil {
					t.Fatalf("verdict %d, %v", ret, err)
				}
				if target == f {
					perClient[ip][p.dst.String()]++
				} else {
					noAffinity[p.dst.String()]++
				}
			}
		}
	}
	chosen := map[string]bool{}
	for ip, got := range perClient {
		if len(got) != 1 {
			t.Errorf("client %s: 100 flows landed on %v, want one backend", ip, got)
		}
		for b := range got {
			chosen[b] = true
		}
	}
	if len(chosen) < 2 {
		t.Errorf("six clients all remembered %v: affinity is not per client", chosen)
	}
	if len(noAffinity) != len(bs) {
		t.Errorf("frontend without affinity used %v, want all %d backends", noAffinity, len(bs))
	}
	c, err := d.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if c.Stats[StatAffinityNew] != 6 || c.Stats[StatAffinityHit] != 6*99 {
		t.Errorf("affinity counters new %d hit %d, want 6 and %d", c.Stats[StatAffinityNew], c.Stats[StatAffinityHit], 6*99)
	}
}
