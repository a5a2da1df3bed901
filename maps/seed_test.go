package maps

import (
	"encoding/binary"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"
)

// unseeded turns testSeeded off for one test: Load draws its seeds and
// starts the SNAT port walk at random, as the agent's does.
func unseeded(t *testing.T) {
	t.Helper()
	testSeeded = false
	t.Cleanup(func() { testSeeded = true })
}

// pinnedMeta reads the tlb_meta record pinned in dir.
func pinnedMeta(t *testing.T, dir string) tcMeta {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(dir, tcMapTlbMeta), &ebpf.LoadPinOptions{ReadOnly: true})
	must(t, err)
	defer m.Close()
	var meta tcMeta
	must(t, m.Lookup(uint32(0), &meta))
	return meta
}

// TestHashSeedPinned checks the flow hash's seed (cfg_hash_seed): drawn
// at random for fresh maps and stamped in tlb_meta, the same after a
// restart on the same pin path, another on a fresh one; maps upgraded
// from layout 8 keep their seed, so no flow moves.
func TestHashSeedPinned(t *testing.T) {
	unseeded(t)
	load := func(opts Options) uint32 {
		t.Helper()
		d, err := Load(opts)
		must(t, err)
		seed := d.hashSeed
		must(t, d.Close())
		if got := pinnedMeta(t, opts.PinPath).HashSeed; got != seed {
			t.Errorf("tlb_meta's hash seed %#x, the programs' %#x", got, seed)
		}
		return seed
	}
	opts := Options{PinPath: filepath.Join(bpffs(t), "topolb"), MaxFrontends: 1024, MaxBackends: 4096, MaxConntrack: 4096}
	first := load(opts)
	if first == 0 || first == layout7HashSeed {
		t.Errorf("fresh maps' seed %#x: want a random one", first)
	}
	if again := load(opts); again != first {
		t.Errorf("seed after a restart %#x, want the pinned %#x", again, first)
	}
	other := opts
	other.PinPath = filepath.Join(bpffs(t), "topolb")
	if fresh := load(other); fresh == first {
		t.Errorf("two fresh pin paths got the same seed %#x", fresh)
	}

	downgrade(t, opts.PinPath)
	if got := load(opts); got != first {
		t.Errorf("seed after the upgrade from layout %d %#x, want the pinned %#x", migrateFrom, got, first)
	}
	if got := load(opts); got != first {
		t.Errorf("seed after a restart of the upgraded maps %#x, want %#x", got, first)
	}
}

// TestSNATPortRandom checks that the SNAT port of a flow from outside is
// not the flow's to predict: the same flow, its entries flushed between
// tries, gets ports from a random start of the walk, not the same one
// each time (a walk started at its hash gives the same port every try).
func TestSNATPortRandom(t *testing.T) {
	unseeded(t)
	e := newFwdEnv(t, Options{})
	f := extFrontend(nodeAddr+":30083", TCP)
	mustSet(t, e.d, f, be(ap(beNode2, 8080)))
	syn := tcpFrame(ap(outside, 40000), f.Addr.String(), tcpSYN, "").bytes()
	const tries = 8
	ports := map[uint16]bool{}
	for range tries {
		ret, out, _ := e.run(t, hookXDP, e.d.xdpProg, syn, "up0")
		if ret != xdpTX {
			t.Fatalf("SYN verdict %d, want XDP_TX", ret)
		}
		// The source port after an untagged Ethernet and a 20-byte IPv4
		// header.
		ports[binary.BigEndian.Uint16(out[34:])] = true
		if _, err := FlushFlows(e.d.opts.PinPath); err != nil {
			t.Fatal(err)
		}
	}
	// Uniform over 28,976 ports, eight tries all alike have a
	// probability of about 2^-103.
	if len(ports) < 2 {
		t.Errorf("%d tries of one flow got the SNAT ports %v: want a random one each", tries, ports)
	}
}
