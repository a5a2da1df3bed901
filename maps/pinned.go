package maps

import (
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/cilium/ebpf"
)

// Pinned is a read-only view of the datapath pinned in a directory, for
// operators (`topolbctl maps`): every map is opened read-only and the
// directory's lock is not taken, so it works beside the agent that owns
// the maps and while no agent runs. Each method reads the kernel afresh;
// entries change while it reads (the datapath runs on), so a listing is
// not one instant.
type Pinned struct {
	dir string
	km  kernelMaps
	// names is nil when the directory has no tlb_names (maps of an agent
	// that did not record names).
	conntrack, ctNew, ct6, ct6New, affinity, stats, names *ebpf.Map
	opened                                                []*ebpf.Map
}

// OpenPinned opens the datapath pinned at dir. It fails, wrapping
// os.ErrNotExist, when dir holds no topolb maps, and wrapping
// ErrLayoutMismatch when they are of another layout than this build
// reads.
func OpenPinned(dir string) (_ *Pinned, err error) {
	if _, err := os.Stat(filepath.Join(dir, tcMapTlbMeta)); err != nil {
		return nil, fmt.Errorf("no topolb datapath pinned at %s: %w", dir, err)
	}
	spec, err := loadTc()
	if err != nil {
		return nil, err
	}
	fingerprint, err := layoutFingerprint(spec)
	if err != nil {
		return nil, fmt.Errorf("layout fingerprint: %w", err)
	}
	if _, err := checkPinnedLayout(dir, fingerprint); err != nil {
		return nil, err
	}
	ncpu, err := ebpf.PossibleCPU()
	if err != nil {
		return nil, fmt.Errorf("possible CPUs: %w", err)
	}
	p := &Pinned{dir: dir, km: kernelMaps{ncpu: ncpu}}
	defer func() {
		if err != nil {
			p.Close()
		}
	}()
	for _, m := range []struct {
		name string
		to   **ebpf.Map
	}{
		{tcMapTlbServices, &p.km.services}, {tcMapTlbBackends, &p.km.backends}, {tcMapTlbRegistry, &p.km.registry},
		{tcMapTlbBackendStats, &p.km.backendStats}, {tcMapTlbSrcRanges, &p.km.srcRanges},
		{tcMapTlbConntrack, &p.conntrack}, {tcMapTlbCtNew, &p.ctNew}, {tcMapTlbAffinity, &p.affinity},
		{tcMapTlbCt6, &p.ct6}, {tcMapTlbCt6New, &p.ct6New},
		{tcMapTlbStats, &p.stats}, {namesMap, &p.names},
	} {
		mp, err := ebpf.LoadPinnedMap(filepath.Join(dir, m.name), &ebpf.LoadPinOptions{ReadOnly: true})
		if m.name == namesMap && errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("open pinned %s: %w", m.name, err)
		}
		*m.to = mp
		p.opened = append(p.opened, mp)
	}
	p.km.maxBackends = p.km.registry.MaxEntries()
	return p, nil
}

// Close releases the maps' file descriptors.
func (p *Pinned) Close() error {
	for _, m := range p.opened {
		m.Close()
	}
	p.opened = nil
	return nil
}

// PinnedFrontend is one frontend as the pinned maps hold it.
type PinnedFrontend struct {
	Frontend Frontend
	// Name is what the agent recorded for it (Service.Name), "" when
	// nothing was.
	Name string
	ProgrammedService
}

// Frontends reads every frontend with its settings and backends (active
// ones with their weight in slots, then draining ones), sorted by
// address, protocol and scope.
func (p *Pinned) Frontends() ([]PinnedFrontend, error) {
	k, err := p.km.snapshot(0, false)
	if err != nil {
		return nil, err
	}
	if err := k.addFlows(ctTables{p.conntrack, p.ctNew}, ctTables{p.ct6, p.ct6New}); err != nil {
		return nil, err
	}
	names, err := p.readNames()
	if err != nil {
		return nil, err
	}
	out := make([]PinnedFrontend, 0, len(k.services))
	for fe, ps := range k.programmed() {
		key, err := svcKey(fe)
		if err != nil {
			return nil, err
		}
		out = append(out, PinnedFrontend{Frontend: fe, Name: names[key], ProgrammedService: ps})
	}
	slices.SortFunc(out, func(a, b PinnedFrontend) int { return compareFrontends(a.Frontend, b.Frontend) })
	return out, nil
}

// compareFrontends orders frontends by address, protocol and scope.
func compareFrontends(a, b Frontend) int {
	return cmp.Or(a.Addr.Compare(b.Addr), cmp.Compare(a.Proto, b.Proto), cmp.Compare(a.Scope, b.Scope))
}

// readNames reads tlb_names, empty when there is none.
func (p *Pinned) readNames() (map[tcSvcKey]string, error) {
	if p.names == nil {
		return map[tcSvcKey]string{}, nil
	}
	return readNames(p.names)
}

// serviceRef is a frontend found by its service id.
type serviceRef struct {
	fe   Frontend
	name string
}

// servicesByID maps service ids to their frontends and names.
func (p *Pinned) servicesByID() (map[uint32]serviceRef, error) {
	svcs, err := p.km.readServices()
	if err != nil {
		return nil, err
	}
	names, err := p.readNames()
	if err != nil {
		return nil, err
	}
	out := make(map[uint32]serviceRef, len(svcs))
	for _, e := range svcs {
		out[e.value.Id] = serviceRef{fe: frontend(e.key), name: names[e.key]}
	}
	return out, nil
}

// flowContext is what decoding flows needs: the datapath's clock now
// and the services by id.
func (p *Pinned) flowContext() (uint64, map[uint32]serviceRef, error) {
	now, err := monotonicNow()
	if err != nil {
		return 0, nil, err
	}
	svcs, err := p.servicesByID()
	return now, svcs, err
}

// FlowBackend is the backend a conntrack or affinity entry holds, by id.
type FlowBackend struct {
	Addr    netip.AddrPort
	ID, Gen uint32
	// Current says the id is still of that generation: the entry is
	// honoured. An entry whose backend is gone is re-balanced on its
	// next use.
	Current bool
}

// ConntrackEntry is one direction of a flow, in one of the two tables.
type ConntrackEntry struct {
	// Table is "established" (assured flows, never evicted) or
	// "unreplied" (flows not established yet and closing ones, LRU).
	Table string
	Proto Protocol
	// Direction is "forward" (client to service) or "reverse" (replies).
	Direction string
	// Src and Dst are the packet's addresses as it arrives; NewSrc and
	// NewDst what the datapath rewrites them to. Forward: the destination
	// becomes the backend and, with SNAT, the source the node's address
	// and port; reverse: the source becomes the frontend and, with SNAT,
	// the destination the client.
	Src, Dst, NewSrc, NewDst netip.AddrPort
	// State is "syn_sent", "established", "closing" (TCP) or "udp".
	State string
	SNAT  bool
	// Expires is the time left before the entry expires; not above 0:
	// expired, waiting for a sweep or a new flow to take its place.
	Expires time.Duration
	// Frontend and Name are the service the flow was balanced at, by its
	// id; Frontend is zero when the id is no longer programmed.
	Frontend Frontend
	Name     string
	Backend  FlowBackend
	// Redirect is how translated packets leave: "stack", "peer",
	// "neigh" or "xdp" (docs/datapath.md), with Ifindex.
	Redirect string
	Ifindex  uint32
}

// ctStateName names an entry's state.
func ctStateName(s uint8) string {
	switch tcCtState(s) {
	case tcCtStateCT_TCP_SYN_SENT:
		return "syn_sent"
	case tcCtStateCT_TCP_ESTABLISHED:
		return "established"
	case tcCtStateCT_TCP_CLOSING:
		return "closing"
	case tcCtStateCT_UDP:
		return "udp"
	default:
		return fmt.Sprintf("state(%d)", s)
	}
}

// redirectName names an entry's forwarding target kind.
func redirectName(r uint8) string {
	switch tcCtRedirect(r) {
	case tcCtRedirectCT_REDIRECT_STACK:
		return "stack"
	case tcCtRedirectCT_REDIRECT_PEER:
		return "peer"
	case tcCtRedirectCT_REDIRECT_NEIGH:
		return "neigh"
	case tcCtRedirectCT_REDIRECT_XDP:
		return "xdp"
	default:
		return fmt.Sprintf("redirect(%d)", r)
	}
}

// Conntrack reads every entry of both tables of each family, IPv4's
// first, the established table before the unreplied one, each table
// sorted by protocol, source and destination.
func (p *Pinned) Conntrack() ([]ConntrackEntry, error) {
	now, svcs, err := p.flowContext()
	if err != nil {
		return nil, err
	}
	var (
		out   []ConntrackEntry
		maxID uint32
	)
	for _, t := range []struct {
		name   string
		m      *ebpf.Map
		family int
	}{{"established", p.conntrack, 4}, {"unreplied", p.ctNew, 4}, {"established", p.ct6, 6}, {"unreplied", p.ct6New, 6}} {
		if t.family == 4 {
			out, err = appendConntrack(out, ct4Entries, t.m, t.name, now, svcs, &maxID)
		} else {
			out, err = appendConntrack(out, ct6Entries, t.m, t.name, now, svcs, &maxID)
		}
		if err != nil {
			return nil, err
		}
	}
	recs, err := p.records(maxID, len(out) > 0)
	if err != nil {
		return nil, err
	}
	for i := range out {
		out[i].Backend.Current = recs.current(out[i].Backend.ID, out[i].Backend.Gen)
	}
	return out, nil
}

// conntrackEntry decodes one entry of family f read at monotonic time
// now (ct_value in bpf/structs.h says which address a direction
// rewrites).
func conntrackEntry[K comparable, V any](f ctFamily[K, V], k K, v V, now uint64) ConntrackEntry {
	c := f.ct(v)
	e := ConntrackEntry{
		Proto: Protocol(f.proto(k)), Direction: "forward",
		Src: f.src(k), Dst: f.dst(k),
		State: ctStateName(c.State), SNAT: c.Flags&uint8(tcCtFlagCT_F_SNAT) != 0,
		Expires:  time.Duration(int64(c.Expires) - int64(now)),
		Backend:  FlowBackend{ID: c.BackendId, Gen: c.BackendGen},
		Redirect: redirectName(c.Redirect), Ifindex: c.Ifindex,
	}
	addr, nat := f.peers(v)
	if tcCtDir(c.Dir) == tcCtDirCT_FORWARD {
		e.NewSrc, e.NewDst, e.Backend.Addr = e.Src, addr, addr
		if e.SNAT {
			e.NewSrc = nat
		}
		return e
	}
	e.Direction = "reverse"
	e.NewSrc, e.NewDst, e.Backend.Addr = addr, e.Dst, e.Src
	if e.SNAT {
		e.NewDst = nat
	}
	return e
}

// appendConntrack appends the entries of the conntrack table m of family
// f, named name, to out, sorted by protocol, source and destination, and
// raises maxID to the highest backend id among them.
func appendConntrack[K comparable, V any](out []ConntrackEntry, f ctFamily[K, V], m *ebpf.Map, name string, now uint64,
	svcs map[uint32]serviceRef, maxID *uint32) ([]ConntrackEntry, error) {
	start := len(out)
	var (
		k K
		v V
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		e := conntrackEntry(f, k, v, now)
		e.Table = name
		c := f.ct(v)
		ref := svcs[c.SvcId]
		e.Frontend, e.Name = ref.fe, ref.name
		*maxID = max(*maxID, c.BackendId)
		out = append(out, e)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read %s conntrack: %w", name, err)
	}
	slices.SortFunc(out[start:], func(a, b ConntrackEntry) int {
		return cmp.Or(cmp.Compare(a.Proto, b.Proto), a.Src.Compare(b.Src), a.Dst.Compare(b.Dst))
	})
	return out, nil
}

// SNATPort is one source port of the node held by a source-translated
// flow: its reply entry, keyed by the backend and the node's address and
// port.
type SNATPort struct {
	// Node is the node's address and the port, Backend the backend the
	// port is held towards (each backend has the whole range).
	Node, Backend netip.AddrPort
	Proto         Protocol
	// Client is who the flow is translated back to.
	Client   netip.AddrPort
	Frontend Frontend
	Name     string
	State    string
	// Expires as ConntrackEntry.Expires: an expired port is taken over
	// by the next flow that needs it, sweep or not.
	Expires time.Duration
}

// SNATPorts lists the ports held, from the reply entries of
// source-translated flows in entries (as Conntrack returns them).
func SNATPorts(entries []ConntrackEntry) []SNATPort {
	var out []SNATPort
	for _, e := range entries {
		if e.Direction != "reverse" || !e.SNAT {
			continue
		}
		out = append(out, SNATPort{Node: e.Dst, Backend: e.Src, Proto: e.Proto, Client: e.NewDst,
			Frontend: e.Frontend, Name: e.Name, State: e.State, Expires: e.Expires})
	}
	slices.SortFunc(out, func(a, b SNATPort) int {
		return cmp.Or(a.Backend.Compare(b.Backend), cmp.Compare(a.Proto, b.Proto), a.Node.Compare(b.Node))
	})
	return out
}

// AffinityEntry is one client's memory of a frontend's backend.
type AffinityEntry struct {
	Client netip.Addr
	// Frontend and Name as in ConntrackEntry.
	Frontend Frontend
	Name     string
	// Backend's Addr is read from the registry, and invalid when its id
	// is no longer of the remembered generation (the memory is then
	// ignored).
	Backend FlowBackend
	// Expires is the time left; each new flow that uses it refreshes it.
	Expires time.Duration
}

// Affinity reads every session-affinity entry, sorted by client and
// frontend.
func (p *Pinned) Affinity() ([]AffinityEntry, error) {
	now, svcs, err := p.flowContext()
	if err != nil {
		return nil, err
	}
	var (
		out   []AffinityEntry
		k     tcAffinityKey
		v     tcAffinityValue
		maxID uint32
	)
	it := p.affinity.Iterate()
	for it.Next(&k, &v) {
		ref := svcs[k.SvcId]
		out = append(out, AffinityEntry{Client: addrFromWire(k.Client), Frontend: ref.fe, Name: ref.name,
			Backend: FlowBackend{ID: v.BackendId, Gen: v.BackendGen}, Expires: time.Duration(int64(v.Expires) - int64(now))})
		maxID = max(maxID, v.BackendId)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read affinity: %w", err)
	}
	recs, err := p.records(maxID, len(out) > 0)
	if err != nil {
		return nil, err
	}
	registry, err := p.km.readRegistry()
	if err != nil {
		return nil, err
	}
	for i := range out {
		b := &out[i].Backend
		if b.Current = recs.current(b.ID, b.Gen); b.Current && int(b.ID) < len(registry) {
			r := registry[b.ID]
			b.Addr = addrPortOf(r.Addr, r.Port)
		}
	}
	slices.SortFunc(out, func(a, b AffinityEntry) int {
		return cmp.Or(a.Client.Compare(b.Client), compareFrontends(a.Frontend, b.Frontend))
	})
	return out, nil
}

// records are backend ids' records, by id.
type records []record

// current reports whether id's record is of generation gen on every CPU.
func (rs records) current(id, gen uint32) bool {
	return int(id) < len(rs) && !rs[id].mixed && rs[id].gen == gen
}

// records reads the records of ids [0, upto] (none without any).
func (p *Pinned) records(upto uint32, any bool) (records, error) {
	if !any {
		return nil, nil
	}
	return p.km.readRecords(min(upto, p.km.maxBackends-1))
}

// Stats reads every named counter, summed over CPUs.
func (p *Pinned) Stats() (map[Stat]uint64, error) {
	return readAllStats(p.stats)
}
