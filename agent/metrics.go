package agent

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

// Metrics are the agent's Prometheus metrics.
type Metrics struct {
	// Services counts decided service ports by policy, mode and IP
	// family (a dual-stack port counts once per family).
	Services *prometheus.GaugeVec
	// Backends counts decided internal backends per service, IP family
	// and backend zone.
	Backends *prometheus.GaugeVec
	// SyncDuration observes how long each sync took.
	SyncDuration prometheus.Histogram
	// EventToMap observes the time from the oldest change in a batch to
	// its map writes being done.
	EventToMap prometheus.Histogram
	// MapWrites counts map writes.
	MapWrites prometheus.Counter
	// ModeChanges counts mode changes of service ports on this node.
	ModeChanges prometheus.Counter
	// Rejected counts objects or fields the decision engine skipped.
	Rejected prometheus.Counter
	// ProgramErrors counts failed service writes by reason.
	ProgramErrors *prometheus.CounterVec
	// Programmed is 1 for each IP family and scope the agent programs
	// frontends in, 0 for one it decides but does not program.
	Programmed *prometheus.GaugeVec
	// Refused counts the services refused over a per-Service cap, by
	// cap (topology.Caps).
	Refused *prometheus.GaugeVec
	// SummaryPending counts the services with a port whose policy needs
	// what the topology summary lacks, decided by hints meanwhile
	// (Config.NodesFromSummary).
	SummaryPending prometheus.Gauge
	// summaryAge exports the age of the topology summary in force.
	summaryAge *summaryAge
}

// NewMetrics creates the metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Services: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "topolb_service_ports", Help: "Service ports decided on this node, by policy, topology mode and IP family.",
		}, []string{"policy", "mode", "family"}),
		Backends: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "topolb_backends", Help: "Internal backends decided per service, IP family and backend zone (programmed when the agent programs the family).",
		}, []string{"service", "family", "zone"}),
		SyncDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "topolb_sync_duration_seconds", Help: "Duration of one sync (decide and write a batch of changes).",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 18),
		}),
		EventToMap: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "topolb_event_to_map_seconds", Help: "Time from an object change being observed to the datapath maps holding its result.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}),
		MapWrites: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "topolb_map_writes_total", Help: "BPF map writes (updates and deletes) made by the agent.",
		}),
		ModeChanges: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "topolb_mode_changes_total", Help: "Topology mode changes of service ports on this node.",
		}),
		Rejected: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "topolb_rejected_inputs_total", Help: "Objects or fields skipped by the decision engine (logged once each).",
		}),
		ProgramErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "topolb_program_errors_total", Help: "Services whose backends could not be written; their previous backends keep serving.",
		}, []string{"reason"}),
		Programmed: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "topolb_programmed", Help: "1 for each IP family and frontend scope (internal: pods and host processes; external: uplinks) the agent programs into its datapath, 0 for one it decides but does not program.",
		}, []string{"family", "scope"}),
		Refused: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "topolb_services_refused", Help: "Services over a per-Service cap (--max-source-ranges-per-service, --max-frontends-per-service), by cap: none of their frontends is served on this node.",
		}, []string{"cap"}),
		SummaryPending: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "topolb_topology_summary_pending_services", Help: "Services with a port whose policy (zone-weighted, topology-keys) needs data of other nodes the topology summary lacks: decided by hints until it has it (--node-watch=own).",
		}),
		summaryAge: &summaryAge{desc: prometheus.NewDesc("topolb_topology_summary_age_seconds",
			"Time since the topology summary in force was written; its writer rewrites it every 5 minutes, so a larger age means the writer is down and policies that read other nodes keep their last known inputs (--node-watch=own; absent until a summary is read).", nil, nil)},
	}
	reg.MustRegister(m.Services, m.Backends, m.SyncDuration, m.EventToMap, m.MapWrites, m.ModeChanges, m.Rejected, m.ProgramErrors, m.Programmed, m.Refused,
		m.SummaryPending, m.summaryAge)
	// Every reason from the start, 0 until it happens: rates and alerts
	// see a series before the first error.
	for _, r := range programErrorReasons {
		m.ProgramErrors.WithLabelValues(r)
	}
	m.setRefused(nil)
	return m
}

// summaryAge is a collector of the topology summary's age at scrape
// time, exported once a summary has been read.
type summaryAge struct {
	desc *prometheus.Desc
	// written is when the summary in force was written, in Unix
	// nanoseconds; 0 before one is read.
	written atomic.Int64
}

func (c *summaryAge) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *summaryAge) Collect(ch chan<- prometheus.Metric) {
	w := c.written.Load()
	if w == 0 {
		return
	}
	ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, time.Since(time.Unix(0, w)).Seconds())
}

// summaryWritten records when the summary in force was written.
func (m *Metrics) summaryWritten(t time.Time) { m.summaryAge.written.Store(t.UnixNano()) }

// Reasons of topolb_program_errors_total.
const (
	programErrorMapFull = "map_full"
	programErrorOther   = "other"
)

var programErrorReasons = []string{programErrorMapFull, programErrorOther}

// setRefused sets Refused from the refused services, every cap's series
// (0 when none is refused over it).
func (m *Metrics) setRefused(refused map[types.NamespacedName]topology.Refusal) {
	for _, c := range []topology.CapName{topology.CapSourceRanges, topology.CapFrontends} {
		n := 0
		for _, r := range refused {
			if r.Cap == c {
				n++
			}
		}
		m.Refused.WithLabelValues(string(c)).Set(float64(n))
	}
}

// setFamilies sets Programmed for every family and scope.
func (m *Metrics) setFamilies(sf ScopeFamilies) {
	for _, family := range topology.Families {
		for _, scope := range Scopes {
			v := 0.0
			if sf.Programs(family, scope) {
				v = 1
			}
			m.Programmed.WithLabelValues(string(family), string(scope)).Set(v)
		}
	}
}

// observeSync records one sync's duration, latency and writes.
func (m *Metrics) observeSync(start, since time.Time, res SyncResult) {
	now := time.Now()
	m.SyncDuration.Observe(now.Sub(start).Seconds())
	if !since.IsZero() {
		m.EventToMap.Observe(now.Sub(since).Seconds())
	}
	m.MapWrites.Add(float64(res.Writes))
}

// serviceDecided moves one service's contribution to the gauges from its
// previous decisions to its new ones, so a sync costs metric updates for
// the services it decided only.
func (m *Metrics) serviceDecided(nn types.NamespacedName, prev, cur []portSummary) {
	for _, p := range prev {
		m.Services.WithLabelValues(string(p.policy), string(p.mode), string(p.family)).Dec()
	}
	for fz := range backendZones(prev) {
		m.Backends.DeleteLabelValues(nn.String(), string(fz.family), fz.zone)
	}
	for _, p := range cur {
		m.Services.WithLabelValues(string(p.policy), string(p.mode), string(p.family)).Inc()
	}
	for fz, n := range backendZones(cur) {
		m.Backends.WithLabelValues(nn.String(), string(fz.family), fz.zone).Set(float64(n))
	}
}

// familyZone is one family and backend zone of a service's backends.
type familyZone struct {
	family v1.IPFamily
	zone   string
}

// backendZones counts the internal backends of a service's ports by
// family and zone.
func backendZones(ps []portSummary) map[familyZone]int {
	zones := map[familyZone]int{}
	for _, p := range ps {
		for _, z := range p.zones {
			zones[familyZone{p.family, z.zone}] += z.n
		}
	}
	return zones
}

func (m *Metrics) programErrors(err error) {
	reason := programErrorOther
	if errors.Is(err, maps.ErrMapFull) {
		reason = programErrorMapFull
	}
	m.ProgramErrors.WithLabelValues(reason).Inc()
}

// trafficMaxAge is how old the per-frontend and per-backend traffic a
// scrape exports may be (maps.Datapath.CachedCounters): those figures
// walk every conntrack entry, about 0.3 s of CPU at a quarter-million,
// which a scrape every second would spend every second (issue 38).
// topolb_datapath_traffic_age_seconds says how old they are.
const trafficMaxAge = 10 * time.Second

// DatapathReader is what the collector reads of the datapath at scrape
// time: maps.Datapath implements it.
type DatapathReader interface {
	CachedCounters(maxAge time.Duration) (maps.Counters, time.Time, error)
	Usage() maps.Usage
	Uplinks() ([]maps.UplinkStatus, error)
	Kernel() maps.KernelReport
}

// DatapathCollector exports, at scrape time, the datapath's counters and
// map occupancy read from the kernel maps, and what the agent's upkeep
// (conntrack sweep, verification) last found.
type DatapathCollector struct {
	DP    DatapathReader
	Agent *Agent

	packets, bytes, flows, backendPackets, drops, reverse, events           *prometheus.Desc
	entries, capacity, ctEntries, ctCreated, ctExpired, ctEvicted           *prometheus.Desc
	ctTable, ctTableCap, snatPorts, snatPortsCap, nodeInfo                  *prometheus.Desc
	driftRepaired, driftRemaining, upkeepErrors, zoneShare, pendingCleanups *prometheus.Desc
	uplinkPath                                                              *prometheus.Desc
	kernelFeature, datapathPath                                             *prometheus.Desc
	sourceRangeDrops, trafficAge                                            *prometheus.Desc

	// byZone is what the traffic read at zonesAt gives by backend zone,
	// reckoned once per read: the zones (Agent.BackendZones) are a map of
	// every backend address, too big to build at every scrape or to keep
	// (issue 38); zonesMu guards it.
	zonesMu sync.Mutex
	zonesAt time.Time
	byZone  zoneTraffic
}

// zoneTraffic is one traffic read by backend zone.
type zoneTraffic struct {
	// packets are the forward packets by backend zone.
	packets map[string]uint64
	// flows are the flows by backend zone of each frontend with unequal
	// weights (Agent.ZoneShares) at the read.
	flows map[maps.Frontend]map[string]uint64
}

// NewDatapathCollector returns a collector over dp and a's decisions and
// upkeep.
func NewDatapathCollector(dp DatapathReader, a *Agent) *DatapathCollector {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, labels, nil)
	}
	return &DatapathCollector{
		DP: dp, Agent: a,
		packets:          d("topolb_datapath_packets_total", "Packets sent to a service frontend.", "frontend"),
		bytes:            d("topolb_datapath_bytes_total", "L3 bytes sent to a service frontend.", "frontend"),
		flows:            d("topolb_datapath_flows_total", "New flows balanced at a service frontend.", "frontend"),
		backendPackets:   d("topolb_datapath_backend_packets_total", "Packets sent to backends, by backend zone.", "zone"),
		drops:            d("topolb_datapath_drops_total", "Packets dropped by the datapath, by reason.", "reason"),
		reverse:          d("topolb_datapath_reverse_nat_total", "Replies rewritten back to a service address."),
		events:           d("topolb_datapath_events_total", "Every named datapath counter (drops, paths, conntrack and affinity events), by name.", "event"),
		entries:          d("topolb_map_entries", "Entries in use in the datapath maps (frontends, backend slots, backend ids).", "map"),
		capacity:         d("topolb_map_capacity", "Capacity of the datapath maps.", "map"),
		ctEntries:        d("topolb_conntrack_entries", "Live conntrack entries at the last sweep (one per flow direction), by protocol and TCP state.", "kind"),
		ctCreated:        d("topolb_conntrack_flows_created_total", "Flows the datapath created (two entries each), since its maps were created."),
		ctExpired:        d("topolb_conntrack_expired_total", "Conntrack entries deleted by sweeps after they expired, since the maps were created."),
		ctEvicted:        d("topolb_conntrack_evicted_total", "Conntrack entries the LRU of the unreplied table evicted to make room (derived at each sweep); established flows are never evicted."),
		ctTable:          d("topolb_conntrack_table_entries", "Live entries at the last sweep of each conntrack table: established (assured flows, never evicted) and unreplied (flows not established yet and closing ones, LRU), IPv4's, and established_ipv6 and unreplied_ipv6, IPv6's.", "table"),
		ctTableCap:       d("topolb_conntrack_table_capacity", "Size of each conntrack table (--max-conntrack, --max-conntrack-unreplied, each family's alike).", "table"),
		snatPorts:        d("topolb_snat_ports_in_use", "SNAT ports held by live flows at the last sweep, by backend (each backend address:port has the whole --snat-ports range).", "backend"),
		snatPortsCap:     d("topolb_snat_ports_capacity", "Size of the SNAT port range (--snat-ports): the ports each backend address:port can be given."),
		nodeInfo:         d("topolb_node_info", "This agent's node and its zone (topology.kubernetes.io/zone, empty before the Node is seen); always 1. Join on instance to label per-node metrics with the node's zone.", "node", "zone"),
		driftRepaired:    d("topolb_datapath_drift_repaired_total", "Inconsistencies between the kernel maps and what the agent programmed, found and repaired by verification, by kind.", "kind"),
		driftRemaining:   d("topolb_datapath_drift_remaining", "Inconsistencies the last repair could not fix, by kind.", "kind"),
		upkeepErrors:     d("topolb_upkeep_errors_total", "Conntrack sweeps and map verifications that failed."),
		pendingCleanups:  d("topolb_datapath_pending_cleanups", "Map cleanups queued after failed writes, retried on every change."),
		kernelFeature:    d("topolb_kernel_feature", "1 where the kernel has a feature the datapath uses, 0 where it lacks it (the datapath then takes the fallback README's requirements name), probed at load; since is the first Linux release with it.", "release", "feature", "since"),
		datapathPath:     d("topolb_datapath_path", "The path the datapath takes for a kernel feature with a choice (tcx links: tcx, or tc for clsact filters), from the kernel and the agent's flags (--tc-attach); always 1.", "feature", "path"),
		uplinkPath:       d("topolb_uplink_path", "The path each uplink balances external traffic on (xdp, xdp-generic, tc, incomplete), read back from the programs attached to it; always 1.", "interface", "path"),
		zoneShare:        d("topolb_zone_flow_share", "For frontends with unequal (zone-weighted) weights: the share of this node's new flows per backend zone, as intended by the decision and as measured by the datapath since the frontend was programmed.", "frontend", "zone", "source"),
		sourceRangeDrops: d("topolb_source_range_drops_total", "New flows to a load-balancer IP refused for coming from outside its loadBalancerSourceRanges, by frontend.", "frontend"),
		trafficAge:       d("topolb_datapath_traffic_age_seconds", fmt.Sprintf("How long ago the per-frontend and per-backend traffic exported (packets, bytes, flows, backend packets, zone shares) was read from the maps: a walk of conntrack, at most every %s; the other datapath counters are read at each scrape.", trafficMaxAge)),
	}
}

// Describe implements prometheus.Collector.
func (c *DatapathCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.packets, c.bytes, c.flows, c.backendPackets, c.drops, c.reverse, c.events,
		c.entries, c.capacity, c.ctEntries, c.ctCreated, c.ctExpired, c.ctEvicted, c.ctTable, c.ctTableCap, c.snatPorts,
		c.snatPortsCap, c.nodeInfo, c.driftRepaired, c.driftRemaining, c.upkeepErrors, c.pendingCleanups, c.zoneShare, c.uplinkPath, c.kernelFeature, c.datapathPath, c.sourceRangeDrops, c.trafficAge} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *DatapathCollector) Collect(ch chan<- prometheus.Metric) {
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}
	u := c.DP.Usage()
	gauge(c.entries, float64(u.Frontends), "frontends")
	gauge(c.capacity, float64(u.MaxFrontends), "frontends")
	gauge(c.entries, float64(u.Slots), "backends")
	gauge(c.capacity, float64(u.MaxBackends), "backends")
	gauge(c.entries, float64(u.BackendIDs), "backend_ids")
	gauge(c.capacity, float64(u.MaxBackends), "backend_ids")
	gauge(c.pendingCleanups, float64(u.Pending))
	gauge(c.snatPortsCap, float64(u.SNATPorts))
	node, zone := c.Agent.NodeZone()
	gauge(c.nodeInfo, 1, node, zone)
	c.collectUpkeep(gauge, counter)
	k := c.DP.Kernel()
	for _, f := range k.Features {
		present := 0.0
		if f.Present {
			present = 1
		}
		gauge(c.kernelFeature, present, k.Release, f.Name, f.Since)
		if f.Path != "" {
			gauge(c.datapathPath, 1, f.Name, f.Path)
		}
	}
	if ups, err := c.DP.Uplinks(); err != nil {
		ch <- prometheus.NewInvalidMetric(c.uplinkPath, err)
	} else {
		for _, up := range ups {
			gauge(c.uplinkPath, 1, up.Interface, up.Path)
		}
	}

	cnt, at, err := c.DP.CachedCounters(trafficMaxAge)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.drops, err)
		return
	}
	gauge(c.trafficAge, time.Since(at).Seconds())
	for f, t := range cnt.Frontends {
		counter(c.packets, float64(t.Packets), f.String())
		counter(c.bytes, float64(t.Bytes), f.String())
		counter(c.flows, float64(t.Flows), f.String())
	}
	byZone := c.zoneTraffic(cnt, at)
	for z, n := range byZone.packets {
		counter(c.backendPackets, float64(n), z)
	}
	for reason, n := range map[string]uint64{
		"no_backend": cnt.Drops.NoBackend, "map_full": cnt.Drops.MapFull,
		"parse_error": cnt.Drops.ParseError, "rewrite_error": cnt.Drops.RewriteError,
	} {
		counter(c.drops, float64(n), reason)
	}
	counter(c.reverse, float64(cnt.ReverseNAT))
	for f, n := range cnt.SourceRangeDrops {
		counter(c.sourceRangeDrops, float64(n), f.String())
	}
	for st, n := range cnt.Stats {
		counter(c.events, float64(n), st.String())
	}
	c.collectShares(gauge, byZone)
}

// zoneTraffic returns the traffic of cnt, read at at, by backend zone:
// reckoned from cnt's per-backend figures when the read is new, else the
// last call's (cnt then reuses an earlier read and has none:
// maps.Datapath.CachedCounters).
func (c *DatapathCollector) zoneTraffic(cnt maps.Counters, at time.Time) zoneTraffic {
	c.zonesMu.Lock()
	defer c.zonesMu.Unlock()
	if c.byZone.packets != nil && c.zonesAt.Equal(at) {
		return c.byZone
	}
	zones := c.Agent.BackendZones()
	zt := zoneTraffic{packets: map[string]uint64{}, flows: map[maps.Frontend]map[string]uint64{}}
	for _, bes := range cnt.Backends {
		for addr, n := range bes {
			zt.packets[zones[addr.Addr().String()]] += n
		}
	}
	for fe := range c.Agent.ZoneShares() {
		measured := map[string]uint64{}
		for addr, t := range cnt.BackendTraffic[fe] {
			measured[zones[addr.Addr().String()]] += t.Flows
		}
		zt.flows[fe] = measured
	}
	c.byZone, c.zonesAt = zt, at
	return zt
}

// collectUpkeep exports what the last sweep and verification found.
func (c *DatapathCollector) collectUpkeep(gauge, counter func(*prometheus.Desc, float64, ...string)) {
	st := c.Agent.UpkeepStatus()
	if st.Swept {
		for kind, n := range st.Sweep.Live {
			gauge(c.ctEntries, float64(n), kind.String())
		}
		counter(c.ctCreated, float64(st.Sweep.Created))
		counter(c.ctExpired, float64(st.Sweep.Swept))
		counter(c.ctEvicted, float64(st.Sweep.Evicted))
		for _, tb := range []struct {
			name       string
			live, size int
		}{
			{"established", st.Sweep.Established, st.Sweep.EstablishedCap},
			{"unreplied", st.Sweep.Unreplied, st.Sweep.UnrepliedCap},
			{"established_ipv6", st.Sweep.Established6, st.Sweep.EstablishedCap},
			{"unreplied_ipv6", st.Sweep.Unreplied6, st.Sweep.UnrepliedCap},
		} {
			gauge(c.ctTable, float64(tb.live), tb.name)
			gauge(c.ctTableCap, float64(tb.size), tb.name)
		}
		for be, n := range st.Sweep.SNATPorts {
			if n > 0 {
				gauge(c.snatPorts, float64(n), be.String())
			}
		}
	}
	// Every kind, 0 until it drifts: rates and alerts see a series from
	// the start.
	for _, kind := range maps.DriftKinds {
		counter(c.driftRepaired, float64(st.Repairs[kind]), string(kind))
		gauge(c.driftRemaining, float64(st.Remaining[kind]), string(kind))
	}
	counter(c.upkeepErrors, float64(st.Errors))
}

// collectShares exports, for every frontend with unequal weights, the
// intended and the measured share of new flows per backend zone.
func (c *DatapathCollector) collectShares(gauge func(*prometheus.Desc, float64, ...string), byZone zoneTraffic) {
	for fe, intended := range c.Agent.ZoneShares() {
		var total uint64
		measured := byZone.flows[fe]
		for _, n := range measured {
			total += n
		}
		for zone, share := range intended {
			gauge(c.zoneShare, share, fe.String(), zone, "intended")
			if total > 0 {
				gauge(c.zoneShare, float64(measured[zone])/float64(total), fe.String(), zone, "measured")
			}
		}
	}
}
