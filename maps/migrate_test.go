package maps

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/topolb/topolb/internal/nettest"
)

// TestMigrationFollowsLayout keeps layout4.go the previous layout: a
// layout bump must freeze the one it leaves there.
func TestMigrationFollowsLayout(t *testing.T) {
	if layoutVersion != migrateFrom+1 {
		t.Fatalf("layoutVersion %d: freeze layout %d in layout4.go (migrateFrom %d)", layoutVersion, layoutVersion-1, migrateFrom)
	}
}

// upgradeState is what readers see of a pinned datapath, expiries left
// out (time passes between the readouts).
type upgradeState struct {
	Frontends []PinnedFrontend
	Conntrack []ConntrackEntry
	Affinity  []AffinityEntry
	SockRev   map[tcSockRevnatKey]tcSockRevnatValue
}

func readUpgradeState(t *testing.T, dir string) upgradeState {
	t.Helper()
	p, err := OpenPinned(dir)
	must(t, err)
	defer p.Close()
	var s upgradeState
	s.Frontends, err = p.Frontends()
	must(t, err)
	s.Conntrack, err = p.Conntrack()
	must(t, err)
	s.Affinity, err = p.Affinity()
	must(t, err)
	for i := range s.Conntrack {
		s.Conntrack[i].Expires = 0
	}
	for i := range s.Affinity {
		s.Affinity[i].Expires = 0
	}
	m, err := ebpf.LoadPinnedMap(filepath.Join(dir, tcMapTlbSockRevnat), &ebpf.LoadPinOptions{ReadOnly: true})
	must(t, err)
	defer m.Close()
	s.SockRev = map[tcSockRevnatKey]tcSockRevnatValue{}
	var (
		k tcSockRevnatKey
		v tcSockRevnatValue
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		s.SockRev[k] = v
	}
	must(t, it.Err())
	return s
}

// downgrade turns the layout 5 maps pinned in dir into what an agent of
// layout 4 pinned: every reshaped map re-created in its layout 4 shape
// with its entries converted back, tlb_meta stamped 4. It is the inverse
// of l4Maps' conversions, for building the test's input only.
func downgrade(t *testing.T, dir string) {
	t.Helper()
	back := func(a tcTlbAddr) uint32 {
		if a == (tcTlbAddr{}) {
			return 0
		}
		return be32(addrFromWire(a))
	}
	svcKey4 := func(k tcSvcKey) l4SvcKey {
		return l4SvcKey{Vip: back(k.Vip), Port: k.Port, Proto: k.Proto, Scope: k.Scope}
	}
	convs := map[string]func(from, to *ebpf.Map) (int, error){
		tcMapTlbServices: func(from, to *ebpf.Map) (int, error) {
			return convertEntries(from, to, ebpf.UpdateAny, func(k tcSvcKey, v tcSvcValue) (l4SvcKey, tcSvcValue) { return svcKey4(k), v })
		},
		tcMapTlbBackends: func(from, to *ebpf.Map) (int, error) {
			return convertEntries(from, to, ebpf.UpdateAny, func(k tcBackendKey, v tcBackendValue) (tcBackendKey, l4BackendValue) {
				return k, l4BackendValue{Addr: back(v.Addr), Port: v.Port, Flags: v.Flags, Id: v.Id, Gen: v.Gen}
			})
		},
		tcMapTlbRegistry: func(from, to *ebpf.Map) (int, error) {
			return convertEntries(from, to, ebpf.UpdateAny, func(k uint32, v tcRegistryValue) (uint32, l4RegistryValue) {
				return k, l4RegistryValue{SvcId: v.SvcId, Addr: back(v.Addr), Port: v.Port, State: v.State, Flags: v.Flags, Gen: v.Gen}
			})
		},
		tcMapTlbAffinity: func(from, to *ebpf.Map) (int, error) {
			return convertEntries(from, to, ebpf.UpdateAny, func(k tcAffinityKey, v tcAffinityValue) (l4AffinityKey, tcAffinityValue) {
				return l4AffinityKey{Client: back(k.Client), SvcId: k.SvcId}, v
			})
		},
		tcMapTlbSockRevnat: func(from, to *ebpf.Map) (int, error) {
			return convertEntries(from, to, ebpf.UpdateAny, func(k tcSockRevnatKey, v tcSockRevnatValue) (l4SockRevnatKey, l4SockRevnatValue) {
				return l4SockRevnatKey{Cookie: k.Cookie, Addr: back(k.Addr), Port: k.Port}, l4SockRevnatValue{Addr: back(v.Addr), Port: v.Port}
			})
		},
		tcMapTlbSrcRanges: func(from, to *ebpf.Map) (int, error) {
			return convertEntries(from, to, ebpf.UpdateAny, func(k tcSrcRangeKey, v uint8) (l4SrcRangeKey, uint8) {
				return l4SrcRangeKey{Prefixlen: k.Prefixlen - v4MappedBits, SvcId: k.SvcId, Addr: be32(addrFromWire(k.Addr))}, v
			})
		},
		namesMap: func(from, to *ebpf.Map) (int, error) {
			return convertEntries(from, to, ebpf.UpdateAny, func(k tcSvcKey, v nameValue) (l4SvcKey, nameValue) { return svcKey4(k), v })
		},
	}
	for _, lm := range l4Maps {
		path := filepath.Join(dir, lm.name)
		cur, err := ebpf.LoadPinnedMap(path, nil)
		must(t, err)
		info, err := cur.Info()
		must(t, err)
		flags := info.Flags
		old, err := ebpf.NewMap(&ebpf.MapSpec{Name: lm.name, Type: lm.typ, KeySize: uint32(binary.Size(lm.key)),
			ValueSize: uint32(binary.Size(lm.value)), MaxEntries: cur.MaxEntries(), Flags: flags})
		must(t, err)
		if _, err := convs[lm.name](cur, old); err != nil {
			t.Fatalf("downgrade %s: %v", lm.name, err)
		}
		cur.Close()
		must(t, os.Remove(path))
		must(t, old.Pin(path))
		old.Close()
	}
	meta, err := ebpf.LoadPinnedMap(filepath.Join(dir, tcMapTlbMeta), nil)
	must(t, err)
	defer meta.Close()
	must(t, meta.Update(uint32(0), &tcMeta{LayoutVersion: migrateFrom, Fingerprint: layout4Fingerprint}, ebpf.UpdateAny))
}

// linkProgram is the id of the program the link pinned at pin runs.
func linkProgram(t *testing.T, pin string) ebpf.ProgramID {
	t.Helper()
	l, err := link.LoadPinnedLink(pin, nil)
	must(t, err)
	defer l.Close()
	info, err := l.Info()
	must(t, err)
	return info.Program
}

func progID(t *testing.T, p *ebpf.Program) ebpf.ProgramID {
	t.Helper()
	info, err := p.Info()
	must(t, err)
	id, ok := info.ID()
	if !ok {
		t.Fatal("program info without id")
	}
	return id
}

// upgradeNode is a namespace with the veth pair upg0, upg1 and the
// options of a datapath for it pinned in a private bpffs.
func upgradeNode(t *testing.T) Options {
	t.Helper()
	dir := filepath.Join(bpffs(t), "topolb")
	node := nettest.NewNS(t, "upg")
	must(t, nettest.Veth(node, "upg0", node, "upg1"))
	return Options{PinPath: dir, NetNS: node.Path, MaxFrontends: 1024, MaxBackends: 4096, MaxConntrack: 4096}
}

// TestUpgradeFromLayout4 builds a datapath's state (frontends with
// affinity, source ranges, a draining backend, names, flows, a socket
// record, attached links), turns its pins into layout 4's, and checks
// that Load migrates them: every entry converted, the state readers see
// equal, the links running the new programs, the flow still on its
// backend, and nothing of layout 4 left.
func TestUpgradeFromLayout4(t *testing.T) {
	opts := upgradeNode(t)
	dir := opts.PinPath
	d1, err := Load(opts)
	must(t, err)
	closed := false
	t.Cleanup(func() {
		if !closed {
			d1.Close()
		}
	})
	web, dns := fe("10.96.7.10:80", TCP), fe("10.96.7.10:53", UDP)
	a, b, c := be("10.1.0.1:8080"), be("10.1.0.2:8080"), be("10.2.0.3:8080")
	mustSetService(t, d1, web, Service{Backends: []Backend{a, b, c}, Affinity: time.Hour, Name: "default/web:http",
		SourceRanges: []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0"), netip.MustParsePrefix("192.0.2.0/24")}})
	mustSetService(t, d1, dns, Service{Backends: []Backend{be("10.1.0.1:53")}, Reject: true})
	must(t, d1.AttachPod("upg0"))
	// A flow through the program: conntrack and affinity entries.
	const client = "10.0.0.40:40000"
	syn := tcpFrame(client, web.Addr.String(), tcpSYN, "").bytes()
	if v, _ := run(t, d1.tcProg, syn); v != tcOK {
		t.Fatalf("SYN verdict %d", v)
	}
	// Drain the flow's backend: it stays in the registry as draining.
	flowBackend := readUpgradeState(t, dir).Conntrack[0].Backend.Addr
	var rest []Backend
	for _, x := range []Backend{a, b, c} {
		if x.Addr != flowBackend {
			rest = append(rest, x)
		}
	}
	drain := Backend{Addr: flowBackend, Draining: true}
	mustSetService(t, d1, web, Service{Backends: append(rest, drain), Affinity: time.Hour, Name: "default/web:http",
		SourceRanges: []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0"), netip.MustParsePrefix("192.0.2.0/24")}})
	// A socket record as connect4 writes it.
	rk := tcSockRevnatKey{Cookie: 77, Addr: wireAddr(flowBackend.Addr()), Port: be16(flowBackend.Port())}
	rv := tcSockRevnatValue{Addr: wireAddr(web.Addr.Addr()), Port: be16(web.Addr.Port())}
	must(t, d1.tcColl.Maps[tcMapTlbSockRevnat].Update(&rk, &rv, ebpf.UpdateAny))
	oldTC := progID(t, d1.tcProg)

	before := readUpgradeState(t, dir)
	if len(before.Conntrack) != 2 || len(before.Affinity) != 1 || len(before.Frontends) != 2 {
		t.Fatalf("state before: %d conntrack, %d affinity entries, %d frontends; want 2, 1, 2",
			len(before.Conntrack), len(before.Affinity), len(before.Frontends))
	}
	must(t, d1.Close())
	closed = true
	downgrade(t, dir)

	// The layout 4 wire format, byte for byte: the frontend key is
	// 10.96.7.10, port 80, TCP, scope.
	svcs, err := ebpf.LoadPinnedMap(filepath.Join(dir, tcMapTlbServices), nil)
	must(t, err)
	raw := make([]byte, 8)
	found := false
	it := svcs.Iterate()
	val := make([]byte, svcs.ValueSize())
	for it.Next(&raw, &val) {
		if raw[6] == protoTCP {
			found = true
			if want := []byte{10, 96, 7, 10, 0, 80, protoTCP}; string(raw[:7]) != string(want) {
				t.Errorf("layout 4 frontend key % x, want % x", raw[:7], want)
			}
		}
	}
	must(t, it.Err())
	svcs.Close()
	if !found {
		t.Fatal("no TCP frontend in the layout 4 services map")
	}
	if _, err := OpenPinned(dir); !errors.Is(err, ErrLayoutMismatch) {
		t.Fatalf("OpenPinned of layout 4 maps: %v, want ErrLayoutMismatch", err)
	}

	// What the old programs write between the conversion and the swap: a
	// socket record (connect4), into the layout 4 map.
	late := l4SockRevnatKey{Cookie: 78, Addr: be32(flowBackend.Addr()), Port: be16(flowBackend.Port())}
	testBeforeSwap = func(pinPath string) {
		m, err := ebpf.LoadPinnedMap(filepath.Join(pinPath, tcMapTlbSockRevnat), nil)
		if err == nil {
			err = m.Update(&late, &l4SockRevnatValue{Addr: be32(web.Addr.Addr()), Port: be16(web.Addr.Port())}, ebpf.UpdateNoExist)
			m.Close()
		}
		if err != nil {
			t.Errorf("write a layout 4 socket record before the swap: %v", err)
		}
	}
	t.Cleanup(func() { testBeforeSwap = nil })
	d2 := newDatapath(t, opts)
	testBeforeSwap = nil
	after := readUpgradeState(t, dir)
	lateKey := tcSockRevnatKey{Cookie: late.Cookie, Addr: rk.Addr, Port: rk.Port}
	if got, ok := after.SockRev[lateKey]; !ok || got != rv {
		t.Errorf("socket record written before the swap: %+v, %v after the upgrade, want %+v", got, ok, rv)
	}
	delete(after.SockRev, lateKey)
	if !reflect.DeepEqual(before, after) {
		t.Errorf("state after the upgrade differs:\nbefore %+v\nafter  %+v", before, after)
	}
	var meta tcMeta
	must(t, d2.meta.Lookup(uint32(0), &meta))
	if meta.LayoutVersion != layoutVersion {
		t.Errorf("tlb_meta layout %d, want %d", meta.LayoutVersion, layoutVersion)
	}
	for _, h := range []hook{hookTC, hookTCEgress} {
		prog := d2.program(h)
		if got, want := linkProgram(t, d2.linkPin(h, "upg0")), progID(t, prog); got != want {
			t.Errorf("link %s runs program %d, want the new %d (the old was %d)", h, got, want, oldTC)
		}
	}
	entries, err := os.ReadDir(dir)
	must(t, err)
	for _, e := range entries {
		if strings.HasSuffix(e.Name(), "_upgrade") {
			t.Errorf("left behind: %s", e.Name())
		}
	}
	// The flow's next packet goes to its backend, the draining one.
	ack := tcpFrame(client, web.Addr.String(), tcpACK, "x")
	v, out := run(t, d2.tcProg, ack.bytes())
	if v != tcOK {
		t.Fatalf("ACK verdict %d", v)
	}
	if want := ack.withAddrs("", flowBackend.String()).bytes(); string(out) != string(want) {
		t.Errorf("ACK after the upgrade:\n got % x\nwant % x (to %s)", out, want, flowBackend)
	}
	// Restarting again is a plain adoption.
	must(t, d2.Close())
	d3, err := Load(opts)
	must(t, err)
	must(t, d3.Close())
}

// TestUpgradeRefusesHostileMaps checks that layout 4 maps of wrong sizes
// fail the upgrade with a clear error and stay pinned as they were.
func TestUpgradeRefusesHostileMaps(t *testing.T) {
	for _, c := range []struct {
		name string
		spec ebpf.MapSpec
	}{
		{"truncated key", ebpf.MapSpec{Type: ebpf.Hash, KeySize: 6, ValueSize: uint32(binary.Size(tcSvcValue{})), MaxEntries: 1024, Flags: 1}},
		{"value of layout 5", ebpf.MapSpec{Type: ebpf.Hash, KeySize: 8, ValueSize: 64, MaxEntries: 1024, Flags: 1}},
		{"other size", ebpf.MapSpec{Type: ebpf.Hash, KeySize: 8, ValueSize: uint32(binary.Size(tcSvcValue{})), MaxEntries: 7, Flags: 1}},
		{"other type", ebpf.MapSpec{Type: ebpf.LRUHash, KeySize: 8, ValueSize: uint32(binary.Size(tcSvcValue{})), MaxEntries: 1024}},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := filepath.Join(bpffs(t), "topolb")
			opts := Options{PinPath: dir, MaxFrontends: 1024, MaxBackends: 4096, MaxConntrack: 4096}
			d1, err := Load(opts)
			must(t, err)
			mustSetService(t, d1, fe("10.96.7.10:80", TCP), Service{Backends: []Backend{be("10.1.0.1:8080")}})
			must(t, d1.Close())
			downgrade(t, dir)
			path := filepath.Join(dir, tcMapTlbServices)
			must(t, os.Remove(path))
			hostile, err := ebpf.NewMap(&c.spec)
			must(t, err)
			defer hostile.Close()
			must(t, hostile.Pin(path))
			pins := pinIDs(t, dir)

			d, err := Load(opts)
			if d != nil {
				d.Close()
			}
			if !errors.Is(err, ErrLayoutMismatch) {
				t.Fatalf("Load: %v, want ErrLayoutMismatch", err)
			}
			t.Logf("error: %v", err)
			if got := pinIDs(t, dir); !reflect.DeepEqual(got, pins) {
				t.Errorf("pins changed:\nbefore %v\nafter  %v", pins, got)
			}
			var meta tcMeta
			m, err := ebpf.LoadPinnedMap(filepath.Join(dir, tcMapTlbMeta), nil)
			must(t, err)
			defer m.Close()
			must(t, m.Lookup(uint32(0), &meta))
			if meta.LayoutVersion != migrateFrom {
				t.Errorf("tlb_meta says layout %d after a failed upgrade, want %d", meta.LayoutVersion, migrateFrom)
			}
		})
	}
}

// pinIDs are the maps pinned in dir, by name, as kernel ids.
func pinIDs(t *testing.T, dir string) map[string]string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	must(t, err)
	out := map[string]string{}
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, e.Name()), &ebpf.LoadPinOptions{ReadOnly: true})
		must(t, err)
		info, err := m.Info()
		must(t, err)
		id, _ := info.ID()
		out[e.Name()] = fmt.Sprint(id)
		m.Close()
	}
	return out
}

// TestUpgradeRollsBackTheSwap checks that a swap that fails part way (a
// pinned link running a program this layout has no counterpart of) puts
// the old programs back on the links it had swapped, and leaves the
// layout 4 maps pinned as they were.
func TestUpgradeRollsBackTheSwap(t *testing.T) {
	opts := upgradeNode(t)
	dir := opts.PinPath
	d1, err := Load(opts)
	must(t, err)
	mustSetService(t, d1, fe("10.96.7.10:80", TCP), Service{Backends: []Backend{be("10.1.0.1:8080")}})
	must(t, d1.AttachPod("upg0"))
	must(t, d1.Close())
	downgrade(t, dir)
	spec, err := loadBaseline()
	must(t, err)
	coll, err := ebpf.NewCollection(spec)
	must(t, err)
	defer coll.Close()
	var ifindex int
	must(t, d1.inNetNS(func() error {
		iface, err := net.InterfaceByName("upg1")
		if err == nil {
			ifindex = iface.Index
		}
		return err
	}))
	// Sorted after the pod's links: swapped last.
	l, err := link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: coll.Programs[baselineProgTcBaseline], Attach: ebpf.AttachTCXIngress})
	must(t, err)
	defer l.Close()
	must(t, l.Pin(filepath.Join(dir, "links", string(hookUplink)+"_upg1")))
	tcPin := filepath.Join(dir, "links", string(hookTC)+"_upg0")
	before, pins := linkProgram(t, tcPin), pinIDs(t, dir)

	_, err = Load(opts)
	if err == nil {
		t.Fatal("Load swapped onto a link running a program it has no counterpart of")
	}
	t.Logf("error: %v", err)
	if got := linkProgram(t, tcPin); got != before {
		t.Errorf("link %s runs program %d after the failed upgrade, want the old %d back", tcPin, got, before)
	}
	if got := pinIDs(t, dir); !reflect.DeepEqual(got, pins) {
		t.Errorf("pins changed:\nbefore %v\nafter  %v", pins, got)
	}
}
