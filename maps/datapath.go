package maps

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"golang.org/x/sys/unix"

	"github.com/topolb/topolb/internal/portrange"
)

// levelTrace is the verbosity of per-map-write logs (developers only):
// klog's -v 5, Kubernetes' "trace level", where Debug is -v 4.
const levelTrace = slog.LevelDebug - 1

// sharedMaps are created once, pinned, and shared by every program.
var sharedMaps = []string{
	tcMapTlbServices, tcMapTlbBackends, tcMapTlbRegistry, tcMapTlbBackendStats,
	tcMapTlbConntrack, tcMapTlbCtNew, tcMapTlbCtSrc, tcMapTlbAffinity, tcMapTlbIfaces, tcMapTlbSockRevnat,
	tcMapTlbStats, tcMapTlbMeta, tcMapTlbSrcRanges, tcMapTlbSrcRangeDrops, tcMapTlbFrags,
	tcMapTlbCt6, tcMapTlbCt6New, tcMapTlbCt6Src, tcMapTlbFrags6, tcMapTlbCtProven,
}

// Datapath is a loaded topolb datapath: programs, pinned maps and the
// userspace mirror of what is programmed. Methods are safe for concurrent
// use.
//
// Its methods are split by job over four parts, each a type of its own
// whose methods the Datapath carries (embedded):
//   - attacher: the programs on hooks (pod veths, uplinks, cgroups), their
//     links and tlb_ifaces (attach.go, uplink.go, host.go, tcfilter.go);
//   - writer: Services into the maps, planned, written as one transaction
//     and mirrored; source ranges (update.go, srcrange.go, txn.go);
//   - upkeep: conntrack sweeps, stale marks of released backends' flows,
//     verify and repair, cached counters (stale.go, stalekernel.go,
//     verify.go, conntrack.go, trafficcache.go, synthetic.go);
//   - readout: what operators and metrics read back from the kernel
//     (read.go, snapshot.go).
//
// The Datapath itself loads, adopts and migrates the maps and programs
// and closes them (datapath.go, adopt.go, names.go, migrate.go,
// kernel.go). The parts share the fields below through their pointer back
// to the Datapath (set once, by Load): the state is one, the jobs apart.
type Datapath struct {
	attacher
	writer
	upkeep
	readout

	mu   sync.Mutex
	opts Options
	log  *slog.Logger
	// lock is the pin directory, held with flock(LOCK_EX) until Close.
	lock *os.File
	// sweepMu serialises SweepConntrack, which runs without mu.
	sweepMu sync.Mutex
	// swept holds the counts of forward entries sweeps deleted, until
	// Counters hands them to their members (stale.go); sweptMu guards it.
	sweptMu sync.Mutex
	swept   map[idGen]Traffic
	// traffic is the last walk's traffic figures, for CachedCounters
	// (trafficcache.go).
	traffic trafficCache
	// staleQ holds the ids released since the last walk that marks their
	// flows stale (stale.go).
	staleQ staleQueue
	// finals are the members released under mu whose live flows
	// flushStale's walk counts, without the lock (stale.go).
	finals []finalCount
	// ncpu is the number of possible CPUs: the length of per-CPU values.
	ncpu int
	// writeFault, when set, is asked before every map write of a change
	// and fails it with the error it returns (the map name is the
	// argument). Nil outside tests, which use it to check rollback.
	writeFault func(what string) error

	tcColl, xdpColl, uplinkColl, sockColl     *ebpf.Collection
	tcProg, tcEgressProg, xdpProg, uplinkProg *ebpf.Program
	// uplinkLBProg is tc_uplink_lb, the uplinks' tc path (UplinkTC).
	uplinkLBProg *ebpf.Program
	// uplinkReasons holds, per uplink this process attached, why its
	// path was chosen (UplinkStatus.Reason).
	uplinkReasons map[string]string
	// kernel is what Load found the kernel offers.
	kernel KernelReport
	// compat is what the programs and the agent do without the features
	// the kernel lacks (compat.go).
	compat compat
	// tcAttach is how this process attaches tc programs: TCAttachTCX or
	// TCAttachTC, chosen at Load (chooseTCAttach).
	tcAttach TCAttach
	// ifindexOf holds the ifindex of each interface this process recorded
	// in tlb_ifaces: once the interface is deleted, neither its filters
	// (gone with it) nor its pinned links (detached, ifindex 0) say which
	// entry to forget.
	ifindexOf map[string]int

	services, backends, registry, backendStats *ebpf.Map
	conntrack, affinity, ifaces, stats, meta   *ebpf.Map
	// ctNew is the unreplied conntrack table (conntrack the established
	// one), ctSrc the per-source budgets of new flows, frags and frags6
	// the ports of fragmented datagrams' first fragments, IPv4's and
	// IPv6's (bpf/frag.h).
	ctNew, ctSrc, frags, frags6 *ebpf.Map
	// ctSrcSeed keys the hash that picks a source's budget cell
	// (cfg_ct_src_seed), drawn for each Load and given to every object
	// it loads.
	ctSrcSeed uint32
	// hashSeed seeds the flow hash (cfg_hash_seed): the node's, kept in
	// tlb_meta across restarts (hashSeedOf).
	hashSeed uint32
	// ct6 and ct6New are the IPv6 conntrack tables, conntrack's and
	// ctNew's twins (keys tcCt6Key, values tcCt6Value): counted, swept
	// (expiry only) and marked stale as the IPv4 ones.
	ct6, ct6New *ebpf.Map
	// srcRanges and srcRangeDrops hold loadBalancerSourceRanges
	// (srcrange.go).
	srcRanges, srcRangeDrops *ebpf.Map
	// names is tlb_names (names.go), which only user space reads.
	names *ebpf.Map

	mirror
}

func (o Options) withDefaults() (Options, error) {
	if o.PinPath == "" {
		o.PinPath = DefaultPinPath
	}
	if o.MaxFrontends == 0 {
		o.MaxFrontends = DefaultMaxFrontends
	}
	if o.MaxBackends == 0 {
		o.MaxBackends = DefaultMaxBackends
	}
	if o.MaxConntrack == 0 {
		o.MaxConntrack = DefaultMaxConntrack
	}
	if o.MaxConntrackNew == 0 {
		o.MaxConntrackNew = DefaultMaxConntrackNew(o.MaxConntrack)
	}
	if o.NewFlowsPerSource == 0 {
		o.NewFlowsPerSource = DefaultNewFlowsPerSource
	}
	if o.MaxAffinity == 0 {
		o.MaxAffinity = DefaultMaxAffinity
	}
	if o.UplinkPath == "" {
		o.UplinkPath = UplinkAuto
	}
	if _, err := ParseUplinkPath(string(o.UplinkPath)); err != nil {
		return o, fmt.Errorf("options: %w", err)
	}
	if o.TCAttach == "" {
		o.TCAttach = TCAttachAuto
	}
	if _, err := ParseTCAttach(string(o.TCAttach)); err != nil {
		return o, fmt.Errorf("options: %w", err)
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.SNATPorts == (portrange.Range{}) {
		o.SNATPorts = DefaultSNATPorts
	}
	if err := o.SNATPorts.Validate(); err != nil {
		return o, fmt.Errorf("options: SNATPorts: %w", err)
	}
	// The backends map holds two buffers; ids must fit the registry.
	if o.MaxBackends > math.MaxInt32/2 || o.MaxFrontends >= math.MaxInt32 {
		return o, fmt.Errorf("options: MaxBackends %d or MaxFrontends %d too large", o.MaxBackends, o.MaxFrontends)
	}
	return o, nil
}

// Load loads the programs and their maps. It first takes an exclusive lock
// on opts.PinPath: a second Datapath on the same directory fails at once
// with an error wrapping ErrLocked, before touching any pin. Maps already
// pinned there with the same layout are adopted: the mirror is rebuilt
// from them and stale entries are garbage-collected, so an agent restart
// keeps every flow. Otherwise the maps are created and pinned. Maps of the
// previous layout are migrated, flows and all (migrate.go). Pinned maps
// of any other layout version, fingerprint or size make Load fail with an
// error wrapping ErrLayoutMismatch.
func Load(opts Options) (_ *Datapath, err error) {
	opts, err = opts.withDefaults()
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(opts.PinPath, 0o700); err != nil {
		return nil, fmt.Errorf("create pin path: %w", err)
	}
	if err := checkBPFFS(opts.PinPath); err != nil {
		return nil, err
	}
	if err := allowBPFMemory(); err != nil {
		return nil, err
	}
	ncpu, err := ebpf.PossibleCPU()
	if err != nil {
		return nil, fmt.Errorf("possible CPUs: %w", err)
	}
	d := &Datapath{opts: opts, log: opts.Logger, ncpu: ncpu, uplinkReasons: map[string]string{}, ifindexOf: map[string]int{}}
	d.attacher.Datapath, d.writer.Datapath, d.upkeep.Datapath, d.readout.Datapath = d, d, d, d
	var seed [4]byte
	if _, err := rand.Read(seed[:]); err != nil {
		return nil, fmt.Errorf("seed of the source budgets' hash: %w", err)
	}
	d.ctSrcSeed = binary.LittleEndian.Uint32(seed[:])
	if d.lock, err = lockDir(opts.PinPath); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			d.Close()
		}
	}()

	tcSpec, err := loadTc()
	if err != nil {
		return nil, err
	}
	fingerprint, err := layoutFingerprint(tcSpec)
	if err != nil {
		return nil, fmt.Errorf("layout fingerprint: %w", err)
	}
	previous := false
	pinnedMeta, err := checkPinnedLayout(opts.PinPath, fingerprint)
	if errors.Is(err, errPreviousLayout) {
		previous = true
	} else if err != nil {
		return nil, err
	}
	if d.hashSeed, err = hashSeedOf(pinnedMeta); err != nil {
		return nil, err
	}
	if d.kernel, err = probeDatapathKernel(tcSpec); err != nil {
		return nil, err
	}
	if err := d.kernel.forceFallbacks(opts.ForceFallbacks); err != nil {
		return nil, fmt.Errorf("options: %w", err)
	}
	if d.tcAttach, err = d.kernel.chooseTCAttach(opts.TCAttach); err != nil {
		return nil, err
	}
	d.log.Info("kernel", d.kernel.LogArgs()...)
	if err := d.kernel.Err(); err != nil {
		return nil, err
	}
	var srcs []ifaceAddr
	if !d.kernel.has(featureFIBLookupSrc) || !d.kernel.has("helper "+helperName(asm.FnCheckMtu)) {
		if err := d.inNetNS(func() error {
			srcs, err = sourceAddrs()
			return err
		}); err != nil {
			return nil, err
		}
		d.log.Info("interfaces' addresses and MTUs for the fallbacks of BPF_FIB_LOOKUP_SRC and bpf_check_mtu", "interfaces", srcs)
	}
	d.compat = newCompat(d.kernel, srcs)
	var mg *migration
	if previous {
		sizeMaps(tcSpec, opts)
		if mg, err = prepareMigration(opts.PinPath, tcSpec, opts.MaxFrontends); err != nil {
			return nil, fmt.Errorf("upgrade maps at %s from layout %d: %w", opts.PinPath, migrateFrom, err)
		}
		defer mg.close()
	}
	if err := d.loadObjects(tcSpec, mg.replacements()); err != nil {
		return nil, err
	}
	if err := d.initMeta(fingerprint); err != nil {
		return nil, err
	}
	if mg != nil {
		d.names, err = mg.names(opts.MaxFrontends)
	} else {
		d.names, err = loadNames(opts.PinPath, opts.MaxFrontends)
	}
	if err != nil {
		return nil, err
	}

	d.mirror = newMirror(opts)
	stats, err := d.adopt()
	if err != nil {
		return nil, fmt.Errorf("adopt pinned maps: %w", err)
	}
	// The adopted members' finals, and ids adoption released: one walk
	// now, before the programs run on them.
	if err := d.flushStale(); err != nil {
		d.log.Error("counting the flows of released backends failed; their totals stay as last reported", "err", err)
	}
	if mg != nil {
		if err := mg.commit(d, fingerprint); err != nil {
			return nil, fmt.Errorf("upgrade maps at %s from layout %d: %w", opts.PinPath, migrateFrom, err)
		}
		d.log.Info("upgraded pinned maps", append([]any{"from", migrateFrom, "to", layoutVersion,
			"kept", len(sharedMaps) - len(mg.replacements()), "swappedLinks", len(mg.swapped)}, mg.logArgs()...)...)
	}
	d.log.Info("datapath loaded", "pinPath", opts.PinPath, "frontends", len(d.fes),
		"slots", d.slots, "staleSlotsRemoved", stats.staleSlots,
		"registryRepaired", stats.registryFixes, "rewritten", stats.rewritten)
	return d, nil
}

// lockDir takes an exclusive, non-blocking flock on the directory dir.
// The lock lives as long as the returned file.
func lockDir(dir string) (*os.File, error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("open pin path to lock it: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("lock %s: %w (is another topolb agent running with this --bpffs?)", dir, ErrLocked)
		}
		return nil, fmt.Errorf("lock %s: %w", dir, err)
	}
	return f, nil
}

// loadObjects creates (or adopts) the pinned maps with the tc object and
// hands them to the XDP, uplink and socket objects.
// replacements, when upgrading from the previous layout, are the maps
// created for it instead of the pinned ones of those names.
func (d *Datapath) loadObjects(tcSpec *ebpf.CollectionSpec, replacements map[string]*ebpf.Map) (err error) {
	sizeMaps(tcSpec, d.opts)
	if err := configure(tcSpec, d.opts, d.compat, d.ctSrcSeed, d.hashSeed); err != nil {
		return err
	}
	for _, name := range sharedMaps {
		tcSpec.Maps[name].Pinning = ebpf.PinByName
	}
	d.tcColl, err = ebpf.NewCollectionWithOptions(tcSpec, ebpf.CollectionOptions{
		Maps: ebpf.MapOptions{PinPath: d.opts.PinPath}, MapReplacements: replacements,
	})
	if errors.Is(err, ebpf.ErrMapIncompatible) {
		return fmt.Errorf("adopt maps at %s: %w: %w", d.opts.PinPath, ErrLayoutMismatch, err)
	}
	if err != nil {
		return fmt.Errorf("load tc program: %w", err)
	}

	xdpSpec, err := loadXdp()
	if err != nil {
		return err
	}
	sizeMaps(xdpSpec, d.opts)
	if err := configure(xdpSpec, d.opts, d.compat, d.ctSrcSeed, d.hashSeed); err != nil {
		return err
	}
	d.xdpColl, err = ebpf.NewCollectionWithOptions(xdpSpec, ebpf.CollectionOptions{MapReplacements: d.sharedMapSet()})
	if err != nil {
		return fmt.Errorf("load xdp program: %w", err)
	}
	uplinkSpec, err := loadUplink()
	if err != nil {
		return err
	}
	sizeMaps(uplinkSpec, d.opts)
	if err := configure(uplinkSpec, d.opts, d.compat, d.ctSrcSeed, d.hashSeed); err != nil {
		return err
	}
	d.uplinkColl, err = ebpf.NewCollectionWithOptions(uplinkSpec, ebpf.CollectionOptions{MapReplacements: d.sharedMapSet()})
	if err != nil {
		return fmt.Errorf("load uplink tc program: %w", err)
	}

	if d.sockColl, err = d.loadSockObject(); err != nil {
		return err
	}

	m := d.tcColl.Maps
	d.services, d.backends, d.registry, d.backendStats = m[tcMapTlbServices], m[tcMapTlbBackends], m[tcMapTlbRegistry], m[tcMapTlbBackendStats]
	d.conntrack, d.affinity, d.ifaces, d.stats, d.meta = m[tcMapTlbConntrack], m[tcMapTlbAffinity], m[tcMapTlbIfaces], m[tcMapTlbStats], m[tcMapTlbMeta]
	d.ctNew, d.ctSrc, d.frags, d.frags6 = m[tcMapTlbCtNew], m[tcMapTlbCtSrc], m[tcMapTlbFrags], m[tcMapTlbFrags6]
	d.ct6, d.ct6New = m[tcMapTlbCt6], m[tcMapTlbCt6New]
	d.srcRanges, d.srcRangeDrops = m[tcMapTlbSrcRanges], m[tcMapTlbSrcRangeDrops]
	d.tcProg = d.tcColl.Programs[tcProgTcLb]
	d.tcEgressProg = d.tcColl.Programs[tcProgTcLbEgress]
	d.xdpProg = d.xdpColl.Programs[xdpProgXdpLb]
	d.uplinkProg = d.uplinkColl.Programs[uplinkProgTcUplink]
	d.uplinkLBProg = d.uplinkColl.Programs[uplinkProgTcUplinkLb]
	return nil
}

// configure sets the load-time constants of an object that has them: the
// SNAT port range and where its walk starts, the per-source budget of new
// flows and the seed of its cells' hash, the flow hash's seed, and the
// fallbacks for what the kernel lacks (bpf/compat.h).
func configure(spec *ebpf.CollectionSpec, opts Options, c compat, srcSeed, hashSeed uint32) error {
	interval, burst := uint64(0), uint32(0)
	if opts.NewFlowsPerSource != NoSourceLimit {
		interval, burst = uint64(time.Second)/uint64(opts.NewFlowsPerSource), opts.NewFlowsPerSource
	}
	vars := map[string]any{
		xdpVarCfgSnatPortMin: opts.SNATPorts.Min, xdpVarCfgSnatPortMax: opts.SNATPorts.Max,
		tcVarCfgCtSrcInterval: interval, tcVarCfgCtSrcBurst: burst, tcVarCfgCtSrcSeed: srcSeed,
		tcVarCfgHashSeed: hashSeed, tcVarCfgSnatPortSeeded: boolByte(testSeeded),
	}
	maps.Copy(vars, c.knobs)
	if !c.cmpXchg {
		if err := withoutCmpXchg(spec); err != nil {
			return err
		}
	}
	for name, v := range vars {
		vs, ok := spec.Variables[name]
		if !ok {
			continue
		}
		if err := vs.Set(v); err != nil {
			return fmt.Errorf("set %s: %w", name, err)
		}
	}
	return nil
}

// sharedMapSet returns the loaded shared maps by name, for objects that
// must use them instead of creating their own.
func (d *Datapath) sharedMapSet() map[string]*ebpf.Map {
	out := make(map[string]*ebpf.Map, len(sharedMaps))
	for _, name := range sharedMaps {
		out[name] = d.tcColl.Maps[name]
	}
	return out
}

// initMeta stamps fresh maps with this layout; adopted maps already carry
// it (checkPinnedLayout).
func (d *Datapath) initMeta(fingerprint uint64) error {
	var meta tcMeta
	if err := d.meta.Lookup(uint32(0), &meta); err != nil {
		return fmt.Errorf("read layout version: %w", err)
	}
	if meta.LayoutVersion != 0 {
		return nil
	}
	meta = tcMeta{LayoutVersion: layoutVersion, HashSeed: d.hashSeed, Fingerprint: fingerprint}
	if err := d.meta.Update(uint32(0), &meta, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("write layout version: %w", err)
	}
	return nil
}

// sizeMaps applies the load-time sizes to a spec.
func sizeMaps(spec *ebpf.CollectionSpec, opts Options) {
	spec.Maps[tcMapTlbServices].MaxEntries = opts.MaxFrontends
	spec.Maps[tcMapTlbBackends].MaxEntries = 2 * opts.MaxBackends
	spec.Maps[tcMapTlbRegistry].MaxEntries = opts.MaxBackends
	spec.Maps[tcMapTlbBackendStats].MaxEntries = opts.MaxBackends
	spec.Maps[tcMapTlbConntrack].MaxEntries = opts.MaxConntrack
	spec.Maps[tcMapTlbCtNew].MaxEntries = opts.MaxConntrackNew
	spec.Maps[tcMapTlbCt6].MaxEntries = opts.MaxConntrack
	spec.Maps[tcMapTlbCt6New].MaxEntries = opts.MaxConntrackNew
	spec.Maps[tcMapTlbSockRevnat].MaxEntries = opts.MaxConntrack
	spec.Maps[tcMapTlbAffinity].MaxEntries = opts.MaxAffinity
	// Indexed by svc id, 1..MaxFrontends.
	spec.Maps[tcMapTlbSrcRangeDrops].MaxEntries = opts.MaxFrontends + 1
}

// checkBPFFS refuses pin paths outside a bpf filesystem, where pinning
// would fail late and confusingly (for example under `ip netns exec`,
// which remounts /sys).
func checkBPFFS(path string) error {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return fmt.Errorf("stat pin path %s: %w", path, err)
	}
	if uint32(st.Type) != unix.BPF_FS_MAGIC {
		return fmt.Errorf("pin path %s is not on a bpf filesystem (mount -t bpf bpf /sys/fs/bpf)", path)
	}
	return nil
}

// errPreviousLayout marks pinned maps of the previous layout, which Load
// migrates (migrate.go) and readers of this build cannot read.
var errPreviousLayout = errors.New("previous layout, upgraded by starting the agent")

// checkPinnedLayout compares the layout version and fingerprint of a
// pinned meta map, if any, before anything else is adopted. It returns
// the pinned record (the zero record when there is none, or it was never
// stamped), also with errPreviousLayout.
func checkPinnedLayout(pinPath string, fingerprint uint64) (tcMeta, error) {
	var meta tcMeta
	path := filepath.Join(pinPath, tcMapTlbMeta)
	m, err := ebpf.LoadPinnedMap(path, nil)
	if errors.Is(err, os.ErrNotExist) {
		return meta, nil
	}
	if err != nil {
		return meta, fmt.Errorf("open pinned %s: %w", path, err)
	}
	defer m.Close()
	if err := m.Lookup(uint32(0), &meta); err != nil {
		return meta, fmt.Errorf("read pinned layout version: %w: %w", ErrLayoutMismatch, err)
	}
	switch {
	case meta.LayoutVersion == 0:
		return meta, nil
	case meta.LayoutVersion == migrateFrom && meta.Fingerprint == prevLayoutFingerprint:
		return meta, fmt.Errorf("maps at %s have layout version %d: %w: %w", pinPath, migrateFrom, errPreviousLayout, ErrLayoutMismatch)
	case meta.LayoutVersion != layoutVersion:
		return meta, fmt.Errorf("maps at %s have layout version %d, this datapath uses %d: %w",
			pinPath, meta.LayoutVersion, layoutVersion, ErrLayoutMismatch)
	case meta.Fingerprint != fingerprint:
		return meta, fmt.Errorf("maps at %s have layout fingerprint %#x, this datapath %#x (same version %d: a layout change without a version bump): %w",
			pinPath, meta.Fingerprint, fingerprint, layoutVersion, ErrLayoutMismatch)
	}
	return meta, nil
}

// layout7HashSeed is the flow hash's seed of layout 7 and before, a
// constant on every node (bpf/node.h's default): maps of those layouts
// keep it, so an upgrade moves no flow, affinity or SNAT port.
const layout7HashSeed = 0x746c6221

// testSeeded, set by the package's tests only, makes Load predictable
// where they predict what the datapath picks: fresh maps get
// layout7HashSeed instead of a random seed, and the SNAT port walk starts
// at the flow's hash instead of at random (cfg_snat_port_seeded).
var testSeeded bool

// hashSeedOf is the flow hash's seed for maps whose pinned tlb_meta
// record is meta (checkPinnedLayout): the record's own, once stamped
// (maps upgraded to layout 8 from layout 7 carry layout7HashSeed there);
// layout7HashSeed for a stamped record without one (layout 7's field was
// padding, always zero; such maps are no longer migrated) and in tests
// (testSeeded); for fresh maps, a new one drawn at random (never 0, which
// stands for none), which initMeta stamps. Drawn
// per node, an outsider cannot predict which backend or SNAT port a flow
// of its choosing gets.
func hashSeedOf(meta tcMeta) (uint32, error) {
	switch {
	case meta.LayoutVersion != 0 && meta.HashSeed != 0:
		return meta.HashSeed, nil
	case meta.LayoutVersion != 0, testSeeded:
		return layout7HashSeed, nil
	}
	for {
		var b [4]byte
		if _, err := rand.Read(b[:]); err != nil {
			return 0, fmt.Errorf("seed of the flow hash: %w", err)
		}
		if seed := binary.LittleEndian.Uint32(b[:]); seed != 0 {
			return seed, nil
		}
	}
}

// boolByte is b as a C flag.
func boolByte(b bool) uint8 {
	if b {
		return 1
	}
	return 0
}

// Close releases the programs, the map file descriptors and the lock on
// the pin path. Pinned maps and links stay: the datapath keeps forwarding
// without the process.
func (d *Datapath) Close() error {
	d.staleQ.stop()
	d.staleQ.closeWalker()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.sockColl != nil {
		d.sockColl.Close()
		d.sockColl = nil
	}
	if d.uplinkColl != nil {
		d.uplinkColl.Close()
		d.uplinkColl = nil
	}
	if d.xdpColl != nil {
		d.xdpColl.Close()
		d.xdpColl = nil
	}
	if d.tcColl != nil {
		d.tcColl.Close()
		d.tcColl = nil
	}
	if d.names != nil {
		d.names.Close()
		d.names = nil
	}
	if d.lock != nil {
		err := d.lock.Close()
		d.lock = nil
		if err != nil {
			return fmt.Errorf("release pin path lock: %w", err)
		}
	}
	return nil
}

// Unpin removes every pin under PinPath: links (interfaces' and the
// socket hooks', which detaches the programs) and maps. The Datapath stays
// usable until Close.
func (d *Datapath) Unpin() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	var errs []error
	if err := d.detachHost(); err != nil {
		errs = append(errs, err)
	}
	ifaces, err := d.attached()
	if err != nil {
		errs = append(errs, err)
	}
	for _, ifname := range ifaces {
		if err := d.detach(ifname); err != nil {
			errs = append(errs, err)
		}
	}
	// By path, so Unpin also works after Close.
	for _, name := range append(slices.Clone(sharedMaps), namesMap) {
		path := filepath.Join(d.opts.PinPath, name)
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("unpin %s: %w", name, err))
		}
	}
	for _, dir := range []string{d.linksDir(), d.opts.PinPath} {
		if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove %s: %w", dir, err))
		}
	}
	return errors.Join(errs...)
}

// closed reports, with mu held, whether Close ran.
func (d *Datapath) closed() bool { return d.tcColl == nil }

// UplinksServeIPv6 says whether the uplinks (XDP and tc on them: NodePorts,
// load-balancer and external IPs reached from outside, ScopeExternal)
// translate IPv6. They do, on both uplink paths (xdp_lb on the XDP path,
// tc_uplink_lb on the tc path; docs/datapath.md, "Addresses"), with IPv6
// FIB forwarding, source NAT and conntrack. Datapath.IPv6 and everything the
// agent, topolbctl and the testbed say about programmed families follow
// from it; a build whose uplinks cannot translate IPv6 sets it false and
// the agent programs IPv6 frontends of scope internal only.
const UplinksServeIPv6 = true

// IPv6 reports whether the datapath serves IPv6 frontends and backends in
// scope, the condition for the agent to hand it IPv6 frontends of that
// scope (the agent programs per family and scope):
//   - ScopeInternal: true. The maps carry either family, tc on pod veths
//     translates IPv6 with its own conntrack tables (layout 6), which the
//     sweep and stale marking cover, and the socket hooks (connect6,
//     sendmsg6, recvmsg6, getpeername6) balance the node's own processes
//     to IPv6 frontends;
//   - ScopeExternal: UplinksServeIPv6.
func (d *Datapath) IPv6(scope Scope) bool { return ServesIPv6(scope) }

// ServesIPv6 is Datapath.IPv6 without a datapath: what this build's
// datapath serves in scope, for callers that decide without loading one.
func ServesIPv6(scope Scope) bool {
	return scope == ScopeInternal || (scope == ScopeExternal && UplinksServeIPv6)
}

// The Datapath's parts (see Datapath): each holds the Datapath it belongs
// to, whose fields and other parts its methods use.
type (
	attacher struct{ *Datapath }
	writer   struct{ *Datapath }
	upkeep   struct{ *Datapath }
	readout  struct{ *Datapath }
)
