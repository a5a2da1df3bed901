package agent

import (
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/types"

	"github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

// Metrics are the agent's Prometheus metrics.
type Metrics struct {
	// Services counts decided service ports by policy and mode.
	Services *prometheus.GaugeVec
	// Backends counts programmed internal backends per service and
	// backend zone.
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
}

// NewMetrics creates the metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Services: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "topolb_service_ports", Help: "Service ports decided on this node, by policy and topology mode.",
		}, []string{"policy", "mode"}),
		Backends: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "topolb_backends", Help: "Internal backends programmed per service and backend zone.",
		}, []string{"service", "zone"}),
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
	}
	reg.MustRegister(m.Services, m.Backends, m.SyncDuration, m.EventToMap, m.MapWrites, m.ModeChanges, m.Rejected, m.ProgramErrors)
	return m
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
func (m *Metrics) serviceDecided(nn types.NamespacedName, prev, cur []topology.PortDecision) {
	for _, d := range prev {
		m.Services.WithLabelValues(string(d.Decision.Policy), string(d.Decision.Mode)).Dec()
	}
	for z := range backendZones(prev) {
		m.Backends.DeleteLabelValues(nn.String(), z)
	}
	for _, d := range cur {
		m.Services.WithLabelValues(string(d.Decision.Policy), string(d.Decision.Mode)).Inc()
	}
	for z, n := range backendZones(cur) {
		m.Backends.WithLabelValues(nn.String(), z).Set(float64(n))
	}
}

// backendZones counts the internal backends of a service's ports by zone.
func backendZones(ds []topology.PortDecision) map[string]int {
	zones := map[string]int{}
	for _, d := range ds {
		for _, ep := range d.Decision.Backends {
			zones[ep.Zone]++
		}
	}
	return zones
}

func (m *Metrics) programErrors(err error) {
	reason := "other"
	if errors.Is(err, maps.ErrMapFull) {
		reason = "map_full"
	}
	m.ProgramErrors.WithLabelValues(reason).Inc()
}

// DatapathCollector exports the datapath's counters and map occupancy,
// read from the kernel maps at scrape time.
type DatapathCollector struct {
	DP *maps.Datapath
	// Zones maps a backend address to its zone, for per-zone packet
	// counts; it is called at scrape time.
	Zones func() map[string]string

	packets, bytes, backendPackets, drops, reverse, entries, capacity *prometheus.Desc
}

// NewDatapathCollector returns a collector over dp.
func NewDatapathCollector(dp *maps.Datapath, zones func() map[string]string) *DatapathCollector {
	return &DatapathCollector{
		DP: dp, Zones: zones,
		packets:        prometheus.NewDesc("topolb_datapath_packets_total", "Packets sent to a service frontend.", []string{"frontend"}, nil),
		bytes:          prometheus.NewDesc("topolb_datapath_bytes_total", "L3 bytes sent to a service frontend.", []string{"frontend"}, nil),
		backendPackets: prometheus.NewDesc("topolb_datapath_backend_packets_total", "Packets sent to backends, by backend zone.", []string{"zone"}, nil),
		drops:          prometheus.NewDesc("topolb_datapath_drops_total", "Packets dropped by the datapath, by reason.", []string{"reason"}, nil),
		reverse:        prometheus.NewDesc("topolb_datapath_reverse_nat_total", "Replies rewritten back to a service address.", nil, nil),
		entries:        prometheus.NewDesc("topolb_map_entries", "Entries in use in the datapath maps.", []string{"map"}, nil),
		capacity:       prometheus.NewDesc("topolb_map_capacity", "Capacity of the datapath maps.", []string{"map"}, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *DatapathCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.packets, c.bytes, c.backendPackets, c.drops, c.reverse, c.entries, c.capacity} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *DatapathCollector) Collect(ch chan<- prometheus.Metric) {
	fe, feMax, be, beMax := c.DP.Capacity()
	ch <- prometheus.MustNewConstMetric(c.entries, prometheus.GaugeValue, float64(fe), "frontends")
	ch <- prometheus.MustNewConstMetric(c.capacity, prometheus.GaugeValue, float64(feMax), "frontends")
	ch <- prometheus.MustNewConstMetric(c.entries, prometheus.GaugeValue, float64(be), "backends")
	ch <- prometheus.MustNewConstMetric(c.capacity, prometheus.GaugeValue, float64(beMax), "backends")
	cnt, err := c.DP.Counters()
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.drops, err)
		return
	}
	for f, t := range cnt.Frontends {
		ch <- prometheus.MustNewConstMetric(c.packets, prometheus.CounterValue, float64(t.Packets), f.String())
		ch <- prometheus.MustNewConstMetric(c.bytes, prometheus.CounterValue, float64(t.Bytes), f.String())
	}
	zones := map[string]string{}
	if c.Zones != nil {
		zones = c.Zones()
	}
	byZone := map[string]uint64{}
	for _, bes := range cnt.Backends {
		for addr, n := range bes {
			byZone[zones[addr.Addr().String()]] += n
		}
	}
	for z, n := range byZone {
		ch <- prometheus.MustNewConstMetric(c.backendPackets, prometheus.CounterValue, float64(n), z)
	}
	for reason, n := range map[string]uint64{
		"no_backend": cnt.Drops.NoBackend, "map_full": cnt.Drops.MapFull,
		"parse_error": cnt.Drops.ParseError, "rewrite_error": cnt.Drops.RewriteError,
	} {
		ch <- prometheus.MustNewConstMetric(c.drops, prometheus.CounterValue, float64(n), reason)
	}
	ch <- prometheus.MustNewConstMetric(c.reverse, prometheus.CounterValue, float64(cnt.ReverseNAT))
}
