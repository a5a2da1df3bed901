package maps

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"sync"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// layoutVersion names the layout of every pinned map and the slot scheme
// the mirror relies on. Bump it on any incompatible change: Load then
// refuses to adopt maps pinned by an older datapath.
const layoutVersion = 1

// levelTrace is the verbosity of per-map-write logs (developers only).
const levelTrace = slog.LevelDebug - 4

// sharedMaps are created once, pinned, and shared by both programs.
var sharedMaps = []string{
	tcMapTlbServices, tcMapTlbBackends, tcMapTlbRegistry, tcMapTlbConntrack,
	tcMapTlbSvcStats, tcMapTlbBeStats, tcMapTlbStats, tcMapTlbMeta,
}

// Datapath is a loaded topolb datapath: programs, pinned maps and the
// userspace mirror of what is programmed. Methods are safe for concurrent
// use.
type Datapath struct {
	mu   sync.Mutex
	opts Options
	log  *slog.Logger

	tcColl, xdpColl *ebpf.Collection
	tcProg, xdpProg *ebpf.Program

	services, backends, registry, conntrack *ebpf.Map
	svcStats, beStats, stats, meta          *ebpf.Map

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
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	// The backends map holds two buffers; ids must fit the registry.
	if o.MaxBackends > math.MaxInt32/2 || o.MaxFrontends >= math.MaxInt32 {
		return o, fmt.Errorf("options: MaxBackends %d or MaxFrontends %d too large", o.MaxBackends, o.MaxFrontends)
	}
	return o, nil
}

// Load loads the programs and their maps. Maps already pinned at
// opts.PinPath with the same layout are adopted: the mirror is rebuilt from
// them and stale slots are garbage-collected, so an agent restart keeps
// every flow. Otherwise the maps are created and pinned. Pinned maps of
// another layout or size make Load fail with an error wrapping
// ErrLayoutMismatch.
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
	if err := checkPinnedLayout(opts.PinPath); err != nil {
		return nil, err
	}

	d := &Datapath{opts: opts, log: opts.Logger}
	defer func() {
		if err != nil {
			d.Close()
		}
	}()

	tcSpec, err := loadTc()
	if err != nil {
		return nil, err
	}
	sizeMaps(tcSpec, opts)
	for _, name := range sharedMaps {
		tcSpec.Maps[name].Pinning = ebpf.PinByName
	}
	d.tcColl, err = ebpf.NewCollectionWithOptions(tcSpec, ebpf.CollectionOptions{
		Maps: ebpf.MapOptions{PinPath: opts.PinPath},
	})
	if errors.Is(err, ebpf.ErrMapIncompatible) {
		return nil, fmt.Errorf("adopt maps at %s: %w: %w", opts.PinPath, ErrLayoutMismatch, err)
	}
	if err != nil {
		return nil, fmt.Errorf("load tc program: %w", err)
	}

	xdpSpec, err := loadXdp()
	if err != nil {
		return nil, err
	}
	sizeMaps(xdpSpec, opts)
	replacements := make(map[string]*ebpf.Map, len(sharedMaps))
	for _, name := range sharedMaps {
		replacements[name] = d.tcColl.Maps[name]
	}
	d.xdpColl, err = ebpf.NewCollectionWithOptions(xdpSpec, ebpf.CollectionOptions{MapReplacements: replacements})
	if err != nil {
		return nil, fmt.Errorf("load xdp program: %w", err)
	}

	m := d.tcColl.Maps
	d.services, d.backends, d.registry, d.conntrack = m[tcMapTlbServices], m[tcMapTlbBackends], m[tcMapTlbRegistry], m[tcMapTlbConntrack]
	d.svcStats, d.beStats, d.stats, d.meta = m[tcMapTlbSvcStats], m[tcMapTlbBeStats], m[tcMapTlbStats], m[tcMapTlbMeta]
	d.tcProg = d.tcColl.Programs[tcProgTcLb]
	d.xdpProg = d.xdpColl.Programs[xdpProgXdpLb]

	var meta tcMeta
	if err := d.meta.Lookup(uint32(0), &meta); err != nil {
		return nil, fmt.Errorf("read layout version: %w", err)
	}
	if meta.LayoutVersion == 0 {
		meta.LayoutVersion = layoutVersion
		if err := d.meta.Update(uint32(0), &meta, ebpf.UpdateAny); err != nil {
			return nil, fmt.Errorf("write layout version: %w", err)
		}
	}

	d.mirror = newMirror(opts)
	stats, err := d.adopt()
	if err != nil {
		return nil, fmt.Errorf("adopt pinned maps: %w", err)
	}
	d.log.Info("datapath loaded", "pinPath", opts.PinPath, "frontends", len(d.fes),
		"backends", d.active, "staleSlotsRemoved", stats.staleSlots, "registryRepaired", stats.registryFixes)
	return d, nil
}

// sizeMaps applies the load-time sizes to a spec.
func sizeMaps(spec *ebpf.CollectionSpec, opts Options) {
	spec.Maps[tcMapTlbServices].MaxEntries = opts.MaxFrontends
	spec.Maps[tcMapTlbBackends].MaxEntries = 2 * opts.MaxBackends
	spec.Maps[tcMapTlbRegistry].MaxEntries = opts.MaxBackends
	spec.Maps[tcMapTlbConntrack].MaxEntries = opts.MaxConntrack
	spec.Maps[tcMapTlbSvcStats].MaxEntries = opts.MaxFrontends + 1
	spec.Maps[tcMapTlbBeStats].MaxEntries = opts.MaxBackends
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

// checkPinnedLayout compares the layout version of a pinned meta map, if
// any, before anything else is adopted.
func checkPinnedLayout(pinPath string) error {
	path := filepath.Join(pinPath, tcMapTlbMeta)
	m, err := ebpf.LoadPinnedMap(path, nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("open pinned %s: %w", path, err)
	}
	defer m.Close()
	var meta tcMeta
	if err := m.Lookup(uint32(0), &meta); err != nil {
		return fmt.Errorf("read pinned layout version: %w: %w", ErrLayoutMismatch, err)
	}
	if meta.LayoutVersion != 0 && meta.LayoutVersion != layoutVersion {
		return fmt.Errorf("maps at %s have layout version %d, this datapath uses %d: %w",
			pinPath, meta.LayoutVersion, layoutVersion, ErrLayoutMismatch)
	}
	return nil
}

// Close releases the programs and map file descriptors. Pinned maps and
// links stay: the datapath keeps forwarding without the process.
func (d *Datapath) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.xdpColl != nil {
		d.xdpColl.Close()
		d.xdpColl = nil
	}
	if d.tcColl != nil {
		d.tcColl.Close()
		d.tcColl = nil
	}
	return nil
}

// Unpin removes every pin under PinPath: links (which detaches the
// programs) and maps. The Datapath stays usable until Close.
func (d *Datapath) Unpin() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	var errs []error
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
	for _, name := range sharedMaps {
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
