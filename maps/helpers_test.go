package maps

import (
	"encoding/binary"
	"math/bits"
	"net/netip"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"

	"github.com/topolb/topolb/internal/nettest"
	"github.com/topolb/topolb/internal/portrange"
)

// Verdicts as the hooks return them.
const (
	tcOK     = 0xffffffff // TC_ACT_UNSPEC (TCX_NEXT): pass on to later tcx programs
	tcShot   = 2          // TC_ACT_SHOT
	xdpDrop  = 1          // XDP_DROP
	xdpPass  = 2          // XDP_PASS
	hashSeed = layout7HashSeed
)

// The tests predict backends and SNAT ports (slotOf, snatPortOf): every
// Load of theirs seeds the flow hash with hashSeed and starts the SNAT
// port walk at the flow's hash (testSeeded). TestHashSeedPinned and
// TestSNATPortRandom turn it off for what they check.
func init() {
	testSeeded = true
}

// requirePrivileges skips tests that need root and BPF (to load programs
// and mount bpffs), as nettest.RequireRoot does.
func requirePrivileges(t testing.TB) {
	t.Helper()
	nettest.RequireRoot(t)
}

// bpffs mounts a private bpf filesystem for one test, so pins never land
// in /sys/fs/bpf, and unmounts it in t.Cleanup.
func bpffs(t testing.TB) string {
	t.Helper()
	requirePrivileges(t)
	return nettest.BPFFS(t)
}

// newDatapath loads a datapath pinned in a private bpffs; small maps keep
// tests fast. Unpinned and closed in t.Cleanup.
func newDatapath(t testing.TB, opts Options) *Datapath {
	t.Helper()
	if opts.PinPath == "" {
		opts.PinPath = filepath.Join(bpffs(t), "topolb")
	}
	if opts.MaxFrontends == 0 {
		opts.MaxFrontends = 1024
	}
	if opts.MaxBackends == 0 {
		opts.MaxBackends = 4096
	}
	if opts.MaxConntrack == 0 {
		opts.MaxConntrack = 4096
	}
	if os.Getenv(forceFallbacksEnv) != "" && opts.ForceFallbacks == nil {
		opts.ForceFallbacks = fallbackFeatures(t)
	}
	d, err := Load(opts)
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	t.Cleanup(func() {
		if err := d.Unpin(); err != nil {
			t.Errorf("Unpin: %v", err)
		}
		d.Close()
	})
	return d
}

// mustFlushStale runs now the walk that marks the flows of released
// backend ids stale, which runs on its own within staleDelay of the
// change: for checks that send the next packet at once.
func mustFlushStale(t testing.TB, d *Datapath) {
	t.Helper()
	if err := d.flushStale(); err != nil {
		t.Fatal(err)
	}
}

// run feeds one frame through prog with BPF_PROG_TEST_RUN.
func run(t testing.TB, prog *ebpf.Program, in []byte) (uint32, []byte) {
	t.Helper()
	out := make([]byte, len(in)+256)
	ret, err := prog.Run(&ebpf.RunOptions{Data: in, DataOut: out})
	if err != nil {
		t.Fatalf("test run: %v", err)
	}
	return ret, out[:len(in)]
}

func fe(addr string, proto Protocol) Frontend {
	return Frontend{Addr: netip.MustParseAddrPort(addr), Proto: proto}
}

func be(addr string) Backend {
	return Backend{Addr: netip.MustParseAddrPort(addr)}
}

func mustSet(t testing.TB, d *Datapath, f Frontend, bs ...Backend) int {
	t.Helper()
	n, err := d.SetBackends(f, bs)
	if err != nil {
		t.Fatalf("SetBackends(%s): %v", f, err)
	}
	return n
}

// slotOf predicts the slot the datapath picks for a new flow.
func slotOf(src, dst netip.AddrPort, proto uint8, count int) int {
	return int(flowHash(src, dst, proto) % uint32(count))
}

// snatPortOf predicts the try-th SNAT port (nat.h snat_port) offered to a
// flow: MurmurHash3's finaliser of the flow hash plus try, over r.
func snatPortOf(src, dst netip.AddrPort, proto uint8, try int, r portrange.Range) uint16 {
	h := flowHash(src, dst, proto) + uint32(try)
	h ^= h >> 16
	h *= 0x85ebca6b
	h ^= h >> 13
	h *= 0xc2b2ae35
	h ^= h >> 16
	return r.Min + uint16(h%uint32(r.Size()))
}

// flowHash is an independent Go copy of flow_hash4 (kernel jhash_3words),
// of either family: an IPv6 address is folded into 32 bits first
// (addr_fold, the XOR of its four words).
func flowHash(src, dst netip.AddrPort, proto uint8) uint32 {
	le := func(a netip.Addr) uint32 {
		if a.Is4() {
			b := a.As4()
			return binary.LittleEndian.Uint32(b[:])
		}
		b := a.As16()
		var x uint32
		for i := 0; i < 16; i += 4 {
			x ^= binary.LittleEndian.Uint32(b[i:])
		}
		return x
	}
	swap := func(p uint16) uint32 { return uint32(bits.ReverseBytes16(p)) }
	return jhash3(le(src.Addr()), le(dst.Addr()), (swap(src.Port())<<16|swap(dst.Port()))^uint32(proto), hashSeed)
}

// jhash3 is an independent Go copy of jhash_3words (bpf/hash.h).
func jhash3(a, b, c, seed uint32) uint32 {
	init := uint32(0xdeadbeef) + 3<<2 + seed
	a, b, c = a+init, b+init, c+init
	c ^= b
	c -= bits.RotateLeft32(b, 14)
	a ^= c
	a -= bits.RotateLeft32(c, 11)
	b ^= a
	b -= bits.RotateLeft32(a, 25)
	c ^= b
	c -= bits.RotateLeft32(b, 16)
	a ^= c
	a -= bits.RotateLeft32(c, 4)
	b ^= a
	b -= bits.RotateLeft32(a, 14)
	c ^= b
	c -= bits.RotateLeft32(b, 24)
	return c
}

// srcCell is an independent Go copy of ct_src_budget's cell (bpf/
// conntrack.h) of src on a hook of scope: an IPv4 address hashed alone,
// an IPv6 one as ct6_src_key narrows it (its /64 on scope external).
func srcCell(d *Datapath, src netip.Addr, scope uint8) uint32 {
	const mask = uint32(tcMapSizeCT_SRC_CELLS) - 1
	seed := d.ctSrcSeed
	if src.Is4() {
		b := src.As4()
		return jhash3(binary.LittleEndian.Uint32(b[:]), 0, 0, seed) & mask
	}
	b := src.As16()
	var w [4]uint32
	for i := range w {
		w[i] = binary.LittleEndian.Uint32(b[4*i:])
	}
	if scope == uint8(tcScopeSCOPE_EXTERNAL) {
		w[2], w[3] = 0, 0
	}
	return jhash3(jhash3(w[0], w[1], w[2], seed), w[3], 0, seed) & mask
}

// sockRefusal is the errno a socket hook of d refuses a call with where it
// would choose errno: EPERM on a kernel without bpf_set_retval.
func sockRefusal(d *Datapath, errno syscall.Errno) syscall.Errno {
	if !d.kernel.has("helper " + helperName(asm.FnSetRetval)) {
		return syscall.EPERM
	}
	return errno
}
