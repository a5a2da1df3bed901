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

// TestMigrationFollowsLayout keeps layout8.go the previous layout: a
// layout bump must freeze the one it leaves there.
func TestMigrationFollowsLayout(t *testing.T) {
	if layoutVersion != migrateFrom+1 {
		t.Fatalf("layoutVersion %d: freeze layout %d in layout8.go (migrateFrom %d)", layoutVersion, layoutVersion-1, migrateFrom)
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

// downConvert turns the entries of this layout's map cur (a reshaped
// one of prevMaps) into the previous layout's in old, where downgrade
// keeps them. Layout 9 reshaped none (layout 8's were the conntrack
// tables, whose values grew).
var downConvert = map[string]func(cur, old *ebpf.Map) (int, error){}

// downgrade turns the maps pinned in dir into what an agent of the
// previous layout pinned: the maps this layout added unpinned, the ones it
// reshaped (prevMaps) pinned as the previous layout made them (its type,
// key and value; their entries converted back where downConvert can,
// one zero entry otherwise), tlb_meta stamped with its version and
// fingerprint (its hash seed kept: layout 8 has one). For building the
// test's input only.
func downgrade(t *testing.T, dir string) {
	t.Helper()
	for _, lm := range prevMaps {
		path := filepath.Join(dir, lm.name)
		if lm.added {
			must(t, os.Remove(path))
			continue
		}
		cur, err := ebpf.LoadPinnedMap(path, nil)
		must(t, err)
		defer cur.Close()
		must(t, os.Remove(path))
		old, err := ebpf.NewMap(&ebpf.MapSpec{Type: lm.typ, KeySize: uint32(binary.Size(lm.key)),
			ValueSize: uint32(binary.Size(lm.value)), MaxEntries: cur.MaxEntries(), Flags: cur.Flags()})
		must(t, err)
		defer old.Close()
		if conv := downConvert[lm.name]; conv != nil {
			_, err = conv(cur, old)
			must(t, err)
		} else {
			must(t, old.Update(make([]byte, old.KeySize()), make([]byte, old.ValueSize()), ebpf.UpdateAny))
		}
		must(t, old.Pin(path))
	}
	meta, err := ebpf.LoadPinnedMap(filepath.Join(dir, tcMapTlbMeta), nil)
	must(t, err)
	defer meta.Close()
	var m tcMeta
	must(t, meta.Lookup(uint32(0), &m))
	must(t, meta.Update(uint32(0), &tcMeta{LayoutVersion: migrateFrom, HashSeed: m.HashSeed, Fingerprint: prevLayoutFingerprint}, ebpf.UpdateAny))
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

// TestUpgradeFromPreviousLayout builds a datapath's state (frontends with
// affinity, source ranges, a draining backend, names, flows, a socket
// record, attached links), turns its pins into the previous layout's, and
// checks that Load migrates them: every entry kept, the state readers see
// unchanged, the links running the new programs, the flow going on to its
// backend, the maps this layout added pinned, and nothing of the upgrade
// left.
func TestUpgradeFromPreviousLayout(t *testing.T) {
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
	if _, err := OpenPinned(dir); !errors.Is(err, ErrLayoutMismatch) {
		t.Fatalf("OpenPinned of layout %d maps: %v, want ErrLayoutMismatch", migrateFrom, err)
	}
	d2 := newDatapath(t, opts)
	after := readUpgradeState(t, dir)
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
	for _, lm := range prevMaps {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, lm.name), nil)
		if err != nil {
			t.Errorf("%s of layout %d not pinned: %v", lm.name, layoutVersion, err)
			continue
		}
		if want := d2.tcColl.Maps[lm.name].Type(); m.Type() != want {
			t.Errorf("%s pinned as a %s after the upgrade, want layout %d's %s", lm.name, m.Type(), layoutVersion, want)
		}
		m.Close()
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

// TestUpgradeRefusesHostileMaps checks that maps of the previous layout
// of wrong shapes or sizes fail the upgrade with a clear error and stay
// pinned as they were.
func TestUpgradeRefusesHostileMaps(t *testing.T) {
	for _, c := range []struct {
		name string
		spec ebpf.MapSpec
	}{
		{"truncated key", ebpf.MapSpec{Type: ebpf.Hash, KeySize: 6, ValueSize: uint32(binary.Size(tcSvcValue{})), MaxEntries: 1024, Flags: 1}},
		{"key of layout 4", ebpf.MapSpec{Type: ebpf.Hash, KeySize: 8, ValueSize: uint32(binary.Size(tcSvcValue{})), MaxEntries: 1024, Flags: 1}},
		{"other value", ebpf.MapSpec{Type: ebpf.Hash, KeySize: uint32(binary.Size(tcSvcKey{})), ValueSize: 64, MaxEntries: 1024, Flags: 1}},
		{"other size", ebpf.MapSpec{Type: ebpf.Hash, KeySize: uint32(binary.Size(tcSvcKey{})), ValueSize: uint32(binary.Size(tcSvcValue{})), MaxEntries: 7, Flags: 1}},
		{"other type", ebpf.MapSpec{Type: ebpf.LRUHash, KeySize: uint32(binary.Size(tcSvcKey{})), ValueSize: uint32(binary.Size(tcSvcValue{})), MaxEntries: 1024}},
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
// previous layout's maps pinned as they were.
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
