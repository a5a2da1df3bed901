// Command topolb-agent is topolb's per-node daemon: it watches Services,
// EndpointSlices and Nodes, decides which backends this node may use for
// every service port, and programs the eBPF datapath with exactly those.
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"
	"k8s.io/client-go/kubernetes"

	"github.com/topolb/topolb/agent"
	"github.com/topolb/topolb/internal/logging"
	"github.com/topolb/topolb/internal/portrange"
	"github.com/topolb/topolb/kube"
	"github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

type flags struct {
	nodeName       string
	kubeconfig     string
	fromFile       string
	podInterfaces  string
	uplinks        string
	uplinkPath     string
	tcAttach       string
	hostServices   bool
	cgroupRoot     string
	apiserver      string
	bpffs          string
	metricsAddress string
	metricsNodeIP  bool
	nodeIP         string
	healthAddress  string
	healthTimeout  time.Duration
	proxyHealth    string
	allowEmpty     bool
	maxFrontends   uint32
	maxBackends    uint32
	maxConntrack   uint32
	maxCtNew       uint32
	perSource      uint32
	snatPorts      string
	events         bool
	coalesce       time.Duration
	retry          time.Duration
	maxAffinity    uint32
	logging        *logging.Options

	nodePortAddresses  []string
	clusterFromOutside bool
	// maxRangesPerService and maxFrontendsPerService are the per-Service
	// caps (topology.Caps).
	maxRangesPerService    int
	maxFrontendsPerService int
	nodePortRange          string
	healthCheckPorts       bool
	sweepInterval          time.Duration
	verifyInterval         time.Duration
	// datapath is "bpf" or "none" (datapathNone).
	datapath string
	// nodeWatch is "own" or "all" (kube.ParseNodeWatch); summaryNamespace
	// holds the topology summary and its Lease.
	nodeWatch        string
	summaryNamespace string
}

// datapathBPF and datapathNone are the values of --datapath.
const (
	datapathBPF  = "bpf"
	datapathNone = "none"
)

func main() {
	var f flags
	cmd := newCommand(&f)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := cmd.ExecuteContext(ctx); err != nil {
		os.Exit(1)
	}
}

// newCommand returns the agent's command with its flags bound to f.
func newCommand(f *flags) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "topolb-agent",
		Short: "Program this node's topology-aware eBPF load balancer",
		Long: `topolb-agent runs on every node. It watches Services, EndpointSlices and Nodes
(from the cluster, or from a manifest file with --from-file; in a cluster,
with --node-watch=own, its own Node only and the others through the
topology summary one elected agent writes), decides for
this node which backends each service port may use (the same decision as
'topolbctl explain'), and writes only those into pinned BPF maps. The tc
programs on pod interfaces, the XDP or tc program on uplinks and the socket hooks
on the cgroup v2 root (the node's own processes) balance traffic from
them. The datapath is pinned under --bpffs and outlives the agent: a
restart adopts it and never flushes it.

With --from-file, a file that cannot be read or decoded changes nothing: the
last good state stays in force, and the error names the file and line. So
does a file that holds no objects or no Node named --node-name (what a file
being rewritten in place looks like), unless --allow-empty-cluster says an
empty cluster is meant. Write the file elsewhere and rename it over the old
one to switch atomically.

/healthz answers 503 when a change has waited longer than --health-timeout
for the maps, or one sync has run longer (the sync loop is stuck); /readyz
answers 200 once the first full sync is in the maps.

--healthz-bind-address serves kube-proxy's proxy health server (port 10256
by default, as kube-proxy): /livez as the /healthz above, and /healthz also
503 while this node is being deleted or carries the cluster autoscaler's
ToBeDeletedByClusterAutoscaler taint, so load balancers drain it. Beside
kube-proxy, which listens there, pass it empty or another port.`,
		SilenceUsage: true,
		Args:         cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return run(cmd.Context(), *f)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.nodeName, "node-name", os.Getenv("NODE_NAME"), "name of this node (default $NODE_NAME)")
	fl.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig file (default: $KUBECONFIG when set, else the in-cluster configuration, else ~/.kube/config)")
	fl.StringVar(&f.apiserver, "apiserver", "", "the API server's address (host:port) instead of the one in the kubeconfig or the in-cluster configuration: on a cluster without kube-proxy, the kubernetes Service's cluster IP is not translated until this agent has programmed it")
	fl.StringVar(&f.fromFile, "from-file", "", "standalone mode: read Nodes, Services and EndpointSlices from this manifest file and reload it when it changes")
	fl.BoolVar(&f.allowEmpty, "allow-empty-cluster", false, "with --from-file: apply a manifest that holds no objects, or no Node named --node-name, as the cluster's state (deleting every frontend); without it such a file is refused and the last good state stays in force")
	fl.StringVar(&f.podInterfaces, "pod-interfaces", "auto", `comma-separated pod (host-side veth) interfaces for the tc program, or "auto": every veth that is not an uplink, followed as they come and go`)
	fl.StringVar(&f.uplinks, "uplinks", "auto", `comma-separated uplink interfaces, balancing traffic from outside the node (--uplink-path), or "auto": the devices of the default routes`)
	fl.StringVar(&f.uplinkPath, "uplink-path", string(maps.UplinkAuto), `how uplinks balance traffic from outside: "xdp" (XDP, with generic mode where the driver has no native XDP), "tc" (tc ingress, --tc-attach), or "auto": per uplink, XDP where the frames it sends back out are taken (a veth whose peer has a native XDP program, a driver where native XDP attaches), tc elsewhere (a veth whose peer has none or cannot be inspected, as a kind node's eth0; drivers without native XDP). Restarting with another path keeps established flows`)
	fl.StringVar(&f.tcAttach, "tc-attach", string(maps.TCAttachAuto), `how the tc programs (pod interfaces, uplinks) are attached: "tcx" (tcx links, Linux 6.6), "tc" (direct-action BPF filters on a clsact qdisc, through netlink; other tools' filters and qdiscs are left alone), or "auto": tcx where the kernel has it, tc elsewhere. Restarting with the other mode keeps established flows`)
	fl.BoolVar(&f.hostServices, "host-services", true, "balance the node's own processes (host network) to cluster IPs, NodePorts, external and load-balancer IPs with cgroup socket hooks; false detaches hooks an earlier agent attached")
	fl.StringVar(&f.cgroupRoot, "cgroup-root", "auto", `the node's cgroup v2 root for the socket hooks (or a directory holding it as "unified", as on hybrid hosts), or "auto": the cgroup2 mount of this process, which in a pod with its own cgroup namespace is not the root and is refused`)
	fl.StringVar(&f.bpffs, "bpffs", maps.DefaultPinPath, "directory on a bpf filesystem where maps and links are pinned")
	fl.StringVar(&f.metricsAddress, "metrics-address", agent.DefaultMetricsAddress, "address serving Prometheus metrics at /metrics (empty disables); localhost by default, since the metrics name every service and count its traffic")
	fl.BoolVar(&f.metricsNodeIP, "metrics-on-node-ip", false, "serve /metrics on --node-ip at the port of --metrics-address instead, so Prometheus can scrape it over the network: opt in only where every client that reaches the node may read service names and traffic counters")
	fl.StringVar(&f.nodeIP, "node-ip", os.Getenv("NODE_IP"), "this node's IP address, for --metrics-on-node-ip (default $NODE_IP)")
	fl.StringVar(&f.healthAddress, "health-address", agent.DefaultHealthAddress, "address serving /healthz, /readyz and /debug/state (empty disables)")
	fl.StringVar(&f.proxyHealth, "healthz-bind-address", agent.DefaultProxyHealthAddress, "address of the proxy health server, kube-proxy's flag of that name: /healthz (503 when the sync loop is behind or this node is being deleted or tainted ToBeDeletedByClusterAutoscaler; cloud load balancers probe it) and /livez; empty disables, and beside kube-proxy, which serves this port, it must be empty or another port")
	fl.DurationVar(&f.healthTimeout, "health-timeout", agent.DefaultHealthTimeout, "/healthz fails when a change has waited longer than this for the maps, or one sync has run longer (kube-proxy: 2 × its 30 s sync period)")
	fl.Uint32Var(&f.maxFrontends, "max-frontends", maps.DefaultMaxFrontends, "capacity of the services map (frontends)")
	fl.Uint32Var(&f.maxBackends, "max-backends", maps.DefaultMaxBackends, "capacity of the backends map (sum of backends over frontends)")
	fl.Uint32Var(&f.maxConntrack, "max-conntrack", 0, "entries of the established conntrack table, two per flow; established flows are never evicted, and when the table is full new flows stay in the unreplied table; 0: from the node's memory, one entry per 64 KiB rounded down to a power of two, 32768 to 1048576 (about 1/512 of the memory)")
	fl.Uint32Var(&f.maxCtNew, "max-conntrack-unreplied", 0, "entries of the LRU conntrack table of flows not established yet and closing ones, the budget a flood of new flows churns; 0: as many as --max-conntrack")
	fl.Uint32Var(&f.perSource, "new-flows-per-source", maps.DefaultNewFlowsPerSource, "new flows a second (bursts of as many) one source address may start that are not established yet (budgets are 65,536 cells per family, picked by a keyed hash of the source: sources that meet in a cell share its budget); each flow that gets established gives its share back; a source whose TCP handshake completed in the last 5 minutes gets eight times as many of its own, keyed by its exact address; over it new flows are dropped; 0 disables the limit")
	fl.StringVar(&f.snatPorts, "snat-ports", maps.DefaultSNATPorts.String(), "source ports (MIN-MAX) given to traffic from outside that is sent to a backend on another node and source-translated to this node's address, each port once per backend address and port; must overlap neither net.ipv4.ip_local_port_range nor the NodePort range (the default is the part of netfilter's masquerade range, 1024-65535, below both Linux defaults)")
	fl.BoolVar(&f.events, "events", true, "emit Kubernetes Events on Services when this node's mode changes or programming fails (rate-limited)")
	fl.DurationVar(&f.coalesce, "sync-coalesce", 2*time.Millisecond, "wait this long after a change so a burst of changes becomes one sync")
	fl.DurationVar(&f.retry, "retry-interval", time.Second, "how often services whose programming failed are retried")
	fl.Uint32Var(&f.maxAffinity, "max-affinity", maps.DefaultMaxAffinity, "entries of the LRU session-affinity table, one per (client address, frontend with ClientIP affinity); beyond, the oldest memories are lost")
	f.logging = logging.AddFlags(fl)
	fl.Lookup("v").Usage = "log verbosity, klog's as in Kubernetes components: 0 operators (mode changes, errors), 4 debug, 5 every map write"
	fl.StringSliceVar(&f.nodePortAddresses, "nodeport-addresses", nil, "serve NodePorts (and health check NodePorts) on this node's addresses inside these CIDRs, IPv4 and IPv6, as kube-proxy's flag (default, and for a family without a CIDR here: the Node's InternalIP and ExternalIP addresses of that family); a CIDR holding 127.0.0.1 (127.0.0.0/8, 0.0.0.0/0) also serves IPv4 NodePorts on 127.0.0.1 to the node's own processes, as kube-proxy's iptables mode does")
	fl.BoolVar(&f.clusterFromOutside, "cluster-ips-from-outside", false, "serve cluster IPs to traffic arriving on the uplinks (a router sending the service CIDR to the nodes), as kube-proxy serves any packet that reaches a node; sent to a backend on another node, it is source-translated to this node's address")
	fl.StringVar(&f.nodePortRange, "service-node-port-range", topology.DefaultNodePortRange.String(), "serve only nodePorts in this range, the apiserver's --service-node-port-range; others are warned about and not served")
	fl.IntVar(&f.maxRangesPerService, "max-source-ranges-per-service", topology.DefaultCaps.SourceRanges, "refuse a Service whose load-balancer IPs carry more loadBalancerSourceRanges than this (both families together): none of its frontends is served on this node, with a Warning Event on it, so one Service cannot fill the source-range table (65,536 slots, each range once per load-balancer frontend) for the others; a Service is refused whole rather than served with fewer ranges, which would let in sources its author kept out; 0: no cap")
	fl.IntVar(&f.maxFrontendsPerService, "max-frontends-per-service", topology.DefaultCaps.Frontends, "refuse a Service that claims more frontends on this node than this (each port in each family on each cluster IP, externalIP, load-balancer IP and NodePort address, once per scope): none of its frontends is served, with a Warning Event on it, so one Service cannot fill the services map (--max-frontends) for the others; 0: no cap")
	fl.BoolVar(&f.healthCheckPorts, "health-check-node-ports", true, "serve the healthCheckNodePort of LoadBalancer Services with externalTrafficPolicy Local, as kube-proxy does")
	fl.DurationVar(&f.sweepInterval, "conntrack-sweep-interval", agent.DefaultSweepInterval, "how often expired conntrack entries are deleted (expired entries are never honoured; the sweep frees room); 0 disables")
	fl.StringVar(&f.datapath, "datapath", datapathBPF, `"bpf": load, attach and program the eBPF datapath; "none": the control plane alone, without privileges: watch, decide and keep the result in memory (/debug/state, /metrics), balancing nothing (benchmarks of the watch and sync cost, such as make bench-scale)`)
	fl.StringVar(&f.nodeWatch, "node-watch", string(kube.NodeWatchOwn), `which Nodes to watch (with a cluster; --from-file reads every Node in the file): "own", this node's only (a field selector, as kube-proxy), and what zone-weighted and topology-keys Services need of the others from the topology summary ConfigMap in --summary-namespace, which one agent elected by a Lease writes (at most every 10 s, when it changes); or "all", every Node, as before the summary`)
	fl.StringVar(&f.summaryNamespace, "summary-namespace", os.Getenv("POD_NAMESPACE"), "namespace of the topology summary ConfigMap and its Lease, topolb's own, required with --node-watch=own (default $POD_NAMESPACE, which the DaemonSet sets from the pod's namespace)")
	fl.DurationVar(&f.verifyInterval, "verify-interval", agent.DefaultVerifyInterval, "how often the kernel maps are compared with what the agent programmed and repaired on drift (also once at start); 0 disables")
	return cmd
}

// run is the agent's life, one step per call: check the flags, load the
// datapath (ErrLocked: another agent owns it, and nothing is touched),
// attach it to the interfaces and the host, build the agent and its
// servers, start the source of cluster state (informers or --from-file),
// and run the sync loop until ctx is done. The datapath stays pinned after
// it returns.
func run(ctx context.Context, f flags) error {
	log, err := f.logging.Apply()
	if err != nil {
		return err
	}
	s, err := checkFlags(f)
	if err != nil {
		return err
	}
	var client kubernetes.Interface
	if f.fromFile == "" {
		if client, err = kubeClient(f.kubeconfig, f.apiserver); err != nil {
			return err
		}
	}
	if f.datapath == datapathNone {
		return runControlPlane(ctx, log, f, s, client)
	}
	checkSNATPorts(log, s.snatPorts, s.options.NodePortRange)
	dp, err := loadDatapath(log, f, s)
	if err != nil {
		return err
	}
	// Close releases file descriptors only: pinned maps and links keep the
	// datapath serving after the agent exits.
	defer dp.Close()
	uplinks, err := attachDatapath(ctx, log, dp, f)
	if err != nil {
		return err
	}
	a, reg, closeAgent := newAgent(log, f, s, client, dp)
	defer closeAgent()
	reg.MustRegister(agent.NewDatapathCollector(dp, a))
	if err := startServers(ctx, log, s.metricsAddress, f.healthAddress, f.proxyHealth, reg, a); err != nil {
		return err
	}
	tracker := kube.NewTracker()
	watchState(ctx, log, f, s, client, tracker, a)
	go a.RunUpkeep(ctx, dp, f.sweepInterval, f.verifyInterval)
	log.Info("agent started", "node", f.nodeName, "bpffs", f.bpffs, "uplinks", uplinks, "podInterfaces", f.podInterfaces)
	a.Run(ctx, tracker, f.coalesce, f.retry)
	log.Info("agent stopping; the datapath stays pinned and keeps serving")
	return nil
}

// runControlPlane is run with --datapath=none: the agent watches and
// decides as always and keeps its results in an agent.MemoryDatapath;
// nothing is loaded, attached or pinned, and there is no upkeep.
func runControlPlane(ctx context.Context, log *slog.Logger, f flags, s settings, client kubernetes.Interface) error {
	a, reg, closeAgent := newAgent(log, f, s, client, agent.NewMemoryDatapath())
	defer closeAgent()
	if err := startServers(ctx, log, s.metricsAddress, f.healthAddress, f.proxyHealth, reg, a); err != nil {
		return err
	}
	tracker := kube.NewTracker()
	watchState(ctx, log, f, s, client, tracker, a)
	log.Info("agent started without a datapath (--datapath=none): nothing is balanced", "node", f.nodeName)
	a.Run(ctx, tracker, f.coalesce, f.retry)
	log.Info("agent stopping")
	return nil
}

// settings are the values parsed out of the flags.
type settings struct {
	// options are the decision engine's: NodePort addresses and range.
	options topology.Options
	// metricsAddress is where /metrics is served; empty: nowhere.
	metricsAddress string
	// snatPorts are the source ports of source-NATed flows.
	snatPorts portrange.Range
	// uplinkPath is how uplinks balance traffic from outside.
	uplinkPath maps.UplinkPath
	// tcAttach is how tc programs are attached.
	tcAttach maps.TCAttach
	// watch is what the cluster's informers watch (kube.Watch): with
	// --from-file, nothing.
	watch kube.WatchOptions
}

// fromSummary reports whether other nodes come from the topology summary.
func (s settings) fromSummary() bool { return s.watch.Nodes == kube.NodeWatchOwn }

// checkFlags returns the settings the flags give, or an error naming the
// first flag that is missing, conflicts with another or does not parse.
func checkFlags(f flags) (settings, error) {
	var s settings
	if f.nodeName == "" {
		return s, errors.New("--node-name (or $NODE_NAME) is required")
	}
	if f.fromFile != "" && f.kubeconfig != "" {
		return s, errors.New("--from-file and --kubeconfig are mutually exclusive")
	}
	if f.datapath != datapathBPF && f.datapath != datapathNone {
		return s, fmt.Errorf("--datapath %q: want %q or %q", f.datapath, datapathBPF, datapathNone)
	}
	if f.allowEmpty && f.fromFile == "" {
		return s, errors.New("--allow-empty-cluster applies to --from-file only")
	}
	nodeWatch, err := kube.ParseNodeWatch(f.nodeWatch)
	if err != nil {
		return s, err
	}
	if f.fromFile == "" {
		s.watch = kube.WatchOptions{Nodes: nodeWatch, NodeName: f.nodeName, SummaryNamespace: f.summaryNamespace}
		if nodeWatch == kube.NodeWatchOwn && f.summaryNamespace == "" {
			return s, errors.New("--node-watch=own reads the topology summary in topolb's namespace: set --summary-namespace or $POD_NAMESPACE (the DaemonSet sets it from metadata.namespace), or watch every Node with --node-watch=all")
		}
	}
	if s.metricsAddress, err = metricsListenAddress(f); err != nil {
		return s, err
	}
	s.options = topology.DefaultOptions()
	if s.options.NodePortAddresses, err = topology.ParseNodePortAddresses(f.nodePortAddresses); err != nil {
		return s, err
	}
	if s.options.NodePortRange, err = portrange.Parse(f.nodePortRange); err != nil {
		return s, fmt.Errorf("--service-node-port-range: %w", err)
	}
	s.options.ClusterIPsFromOutside = f.clusterFromOutside
	if f.maxRangesPerService < 0 || f.maxFrontendsPerService < 0 {
		return s, errors.New("--max-source-ranges-per-service and --max-frontends-per-service must not be negative")
	}
	s.options.Caps = topology.Caps{SourceRanges: f.maxRangesPerService, Frontends: f.maxFrontendsPerService}
	if s.snatPorts, err = portrange.Parse(f.snatPorts); err != nil {
		return s, fmt.Errorf("--snat-ports: %w", err)
	}
	if s.uplinkPath, err = maps.ParseUplinkPath(f.uplinkPath); err != nil {
		return s, fmt.Errorf("--uplink-path: %w", err)
	}
	if s.tcAttach, err = maps.ParseTCAttach(f.tcAttach); err != nil {
		return s, fmt.Errorf("--tc-attach: %w", err)
	}
	return s, nil
}

// kubeClient returns a client of the cluster in the kubeconfig (or the
// in-cluster configuration), at --apiserver's address when one is given.
func kubeClient(kubeconfig, apiserver string) (kubernetes.Interface, error) {
	cfg, err := kube.RESTConfig(kubeconfig)
	if err != nil {
		return nil, err
	}
	if apiserver != "" {
		if cfg.Host, err = apiServerURL(apiserver); err != nil {
			return nil, err
		}
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("create client: %w", err)
	}
	return client, nil
}

// conntrackSize is --max-conntrack, or when 0 the size for the node's
// memory (maps.ConntrackSizeFor).
func conntrackSize(flag uint32) (uint32, error) {
	if flag != 0 {
		return flag, nil
	}
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil {
		return 0, fmt.Errorf("read the node's memory to size conntrack (set --max-conntrack): %w", err)
	}
	return maps.ConntrackSizeFor(uint64(si.Totalram) * uint64(si.Unit)), nil
}

// loadDatapath loads (or adopts) the datapath pinned under --bpffs,
// mounting a bpf filesystem first where the node has none. The error says
// why it could not: another agent holds the pin path's lock (wrapping
// maps.ErrLocked; nothing was touched), missing capabilities, or the
// load's own error.
func loadDatapath(log *slog.Logger, f flags, s settings) (*maps.Datapath, error) {
	if err := ensureBPFFS(log, f.bpffs, bpffsRoot); err != nil {
		return nil, err
	}
	maxConntrack, err := conntrackSize(f.maxConntrack)
	if err != nil {
		return nil, err
	}
	perSource := f.perSource
	if perSource == 0 {
		perSource = maps.NoSourceLimit
	}
	dp, err := maps.Load(maps.Options{
		PinPath: f.bpffs, MaxFrontends: f.maxFrontends, MaxBackends: f.maxBackends,
		MaxConntrack: maxConntrack, MaxConntrackNew: f.maxCtNew, NewFlowsPerSource: perSource,
		MaxAffinity: f.maxAffinity, SNATPorts: s.snatPorts, UplinkPath: s.uplinkPath, TCAttach: s.tcAttach,
		Logger: log.With("component", "datapath"),
	})
	switch {
	case err == nil:
		return dp, nil
	case errors.Is(err, maps.ErrLocked):
		// Nothing was touched: the agent that holds the lock keeps the
		// datapath.
		return nil, fmt.Errorf("another agent owns %s; this one exits without touching its links or maps: %w", f.bpffs, err)
	case errors.Is(err, os.ErrPermission):
		// cilium/ebpf suggests raising MEMLOCK, which is not the cause on
		// kernels that account BPF memory to cgroups.
		return nil, fmt.Errorf("load datapath (the agent needs CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON): %w", err)
	}
	return nil, fmt.Errorf("load datapath: %w", err)
}

// attachDatapath attaches the datapath's programs to the uplinks (XDP or
// tc, --uplink-path), the pod interfaces (tc, followed as they come and
// go with "auto") and the node's cgroup (socket hooks), and returns the
// uplinks it chose.
func attachDatapath(ctx context.Context, log *slog.Logger, dp *maps.Datapath, f flags) ([]string, error) {
	uplinks, pods, autoPods, err := agent.ParseInterfaces(f.uplinks, f.podInterfaces)
	if err != nil {
		return nil, err
	}
	ifaces := &agent.Interfaces{DP: dp, Log: log.With("component", "interfaces"), Uplinks: uplinks, Pods: pods, AutoPods: autoPods}
	if err := ifaces.Attach(ctx); err != nil {
		return nil, err
	}
	if err := attachHost(dp, f); err != nil {
		return nil, err
	}
	return uplinks, nil
}

// newAgent builds the agent on dp with its metrics, health check servers
// (--health-check-node-ports) and Kubernetes events (--events, with a
// client), and returns it, the metrics registry (without the datapath's
// collector: the caller adds it where there is a datapath), and a close
// function that stops the events and the health check servers.
func newAgent(log *slog.Logger, f flags, s settings, client kubernetes.Interface, dp agent.Datapath) (*agent.Agent, *prometheus.Registry, func()) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	cfg := agent.Config{
		NodeName: f.nodeName, Options: s.options,
		Logger: log.With("component", "agent"), Metrics: agent.NewMetrics(reg), HealthTimeout: f.healthTimeout,
		NodesFromSummary: s.fromSummary(),
	}
	var hcs *agent.HealthChecks
	if f.healthCheckPorts {
		hcs = &agent.HealthChecks{Log: log.With("component", "healthcheck")}
		cfg.HealthChecks = hcs
	}
	var ev *agent.KubeEvents
	if client != nil && f.events {
		ev = agent.NewKubeEvents(client, f.nodeName)
		cfg.Events = ev
	}
	a := agent.New(cfg, dp)
	if hcs != nil {
		hcs.Healthy = func() bool { return a.Health().Healthy }
	}
	closeAll := func() {
		if ev != nil {
			ev.Shutdown(context.Background())
		}
		if hcs != nil {
			hcs.Close()
		}
	}
	return a, reg, closeAll
}

// startServers serves /metrics at metricsAddress, the agent's health
// endpoints at healthAddress and kube-proxy's at proxyHealthAddress (an
// empty address serves nothing) until ctx is done; the error says which
// could not listen (kube-proxy, too, exits when its health server cannot).
func startServers(ctx context.Context, log *slog.Logger, metricsAddress, healthAddress, proxyHealthAddress string, reg *prometheus.Registry, a *agent.Agent) error {
	if metricsAddress != "" {
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		if err := serve(ctx, log, "metrics", metricsAddress, mux); err != nil {
			return err
		}
	}
	if healthAddress != "" {
		if err := serve(ctx, log, "health", healthAddress, a.HealthHandler()); err != nil {
			return err
		}
	}
	if proxyHealthAddress != "" {
		if err := serve(ctx, log, "proxy health (--healthz-bind-address; beside kube-proxy, leave it empty or take another port)", proxyHealthAddress, a.ProxyHealthHandler()); err != nil {
			return err
		}
	}
	return nil
}

// watchState starts feeding tracker, until ctx is done, from --from-file
// (a manifest that fails to load or is refused is logged and leaves the
// last good state in force) or else from the cluster's informers; with
// --node-watch=own it also stands for the topology summary's writer
// (kube.SummaryWriter), for the label keys a's Services name.
func watchState(ctx context.Context, log *slog.Logger, f flags, s settings, client kubernetes.Interface, tracker *kube.Tracker, a *agent.Agent) {
	if f.fromFile == "" {
		go func() {
			if err := kube.Watch(ctx, client, tracker, s.watch); err != nil {
				log.Error("watch cluster", "err", err)
			}
		}()
		if s.fromSummary() {
			w := &kube.SummaryWriter{
				Client: client, Namespace: s.watch.SummaryNamespace, Identity: f.nodeName,
				LabelKeys: a.SummaryLabelKeys, Log: log.With("component", "summary-writer"),
			}
			go func() {
				if err := w.Run(ctx); err != nil {
					log.Error("topology summary writer", "err", err)
				}
			}()
		}
		return
	}
	w := &kube.FileWatcher{
		Path: f.fromFile, Tracker: tracker, NodeName: f.nodeName, AllowEmpty: f.allowEmpty,
		OnLoad: func(objs *kube.Objects, warnings []string) {
			log.Info("manifest applied", "file", f.fromFile, "nodes", len(objs.Nodes), "services", len(objs.Services),
				"endpointSlices", len(objs.Slices), "warnings", len(warnings))
			for _, w := range warnings {
				log.Warn("manifest", "warning", w)
			}
		},
		OnError: func(err error) {
			if errors.Is(err, kube.ErrNotApplied) {
				log.Warn("manifest not applied; the last good state stays in force (--allow-empty-cluster applies such a file)",
					"file", f.fromFile, "reason", err)
				return
			}
			log.Error("manifest not loaded; the last good state stays in force", "file", f.fromFile, "err", err)
		},
	}
	go w.Run(ctx)
}

// apiServerURL returns the URL of --apiserver's host:port, or an error
// naming the flag when it is not one.
func apiServerURL(addr string) (string, error) {
	host, port, err := net.SplitHostPort(addr)
	if err == nil && (host == "" || port == "") {
		err = errors.New("empty host or port")
	}
	if err != nil {
		return "", fmt.Errorf("--apiserver %q: want host:port, the API server's address: %w", addr, err)
	}
	return "https://" + net.JoinHostPort(host, port), nil
}

// attachHost attaches the socket hooks for host-network clients to the
// node's cgroup v2 root, or with --host-services=false detaches the ones an
// earlier agent pinned.
func attachHost(dp *maps.Datapath, f flags) error {
	if !f.hostServices {
		if err := dp.DetachHost(); err != nil {
			return fmt.Errorf("detach socket hooks: %w", err)
		}
		return nil
	}
	root, err := maps.CgroupRoot(f.cgroupRoot)
	if err != nil {
		return fmt.Errorf("socket hooks for host-network clients (--cgroup-root, or --host-services=false): %w", err)
	}
	if err := dp.AttachHost(root); err != nil {
		return fmt.Errorf("socket hooks for host-network clients (--host-services=false turns them off): %w", err)
	}
	return nil
}

// localPortRange is where the node's own connections take their source
// ports.
const localPortRange = "/proc/sys/net/ipv4/ip_local_port_range"

// checkSNATPorts warns when the SNAT port range overlaps the node's
// ephemeral ports (a translated flow could take the 5-tuple of a
// connection the node opens itself, whose replies XDP would then
// translate) or the NodePort range (a reply could be taken for traffic to
// a NodePort).
func checkSNATPorts(log *slog.Logger, snat, nodePorts portrange.Range) {
	if snat.Overlaps(nodePorts) {
		log.Warn("--snat-ports overlaps the NodePort range", "snatPorts", snat, "nodePorts", fmt.Sprintf("%d-%d", nodePorts.Min, nodePorts.Max))
	}
	b, err := os.ReadFile(localPortRange)
	if err != nil {
		log.Warn("cannot read the node's ephemeral port range to check --snat-ports against it", "err", err)
		return
	}
	var lo, hi uint16
	if _, err := fmt.Sscan(string(b), &lo, &hi); err != nil {
		log.Warn("cannot parse the node's ephemeral port range", "file", localPortRange, "err", err)
		return
	}
	if eph := (portrange.Range{Min: lo, Max: hi}); snat.Overlaps(eph) {
		log.Warn("--snat-ports overlaps the node's ephemeral ports (net.ipv4.ip_local_port_range): a translated flow may collide with a connection of the node itself",
			"snatPorts", snat, "ephemeral", eph)
	}
}

// serve listens on addr and serves h until ctx is done.
func serve(ctx context.Context, log *slog.Logger, what, addr string, h http.Handler) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listen %s on %s: %w", what, addr, err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdown)
	}()
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("serve", "what", what, "err", err)
		}
	}()
	return nil
}

// metricsListenAddress returns where /metrics is served: --metrics-address,
// or with --metrics-on-node-ip, --node-ip at its port.
func metricsListenAddress(f flags) (string, error) {
	if !f.metricsNodeIP {
		return f.metricsAddress, nil
	}
	_, port, err := net.SplitHostPort(f.metricsAddress)
	if err != nil {
		return "", fmt.Errorf("--metrics-on-node-ip takes the port of --metrics-address %q: %w", f.metricsAddress, err)
	}
	ip := net.ParseIP(f.nodeIP)
	if ip == nil {
		return "", fmt.Errorf("--metrics-on-node-ip needs this node's IP in --node-ip or $NODE_IP, got %q", f.nodeIP)
	}
	return net.JoinHostPort(ip.String(), port), nil
}

// bpffsRoot is where a node's bpf filesystem is mounted.
const bpffsRoot = "/sys/fs/bpf"

// ensureBPFFS checks that pinPath is, or will be created, on a bpf
// filesystem, and mounts one at root only where a node has none:
//   - pinPath exists: it must be on a bpf filesystem. In a pod it is the
//     node's /sys/fs/bpf/topolb, bind-mounted by the kubelet, while the
//     pod's own /sys/fs/bpf is an empty directory of the container's sysfs:
//     nothing is mounted over it (that would hide the pins, and needs
//     CAP_SYS_ADMIN).
//   - otherwise its nearest existing ancestor must be on one (maps.Load
//     creates the rest), or be root itself, where a bpf filesystem is then
//     mounted, as a node without systemd's bpffs mount needs.
func ensureBPFFS(log *slog.Logger, pinPath, root string) error {
	dir := filepath.Clean(pinPath)
	for {
		var st unix.Statfs_t
		err := unix.Statfs(dir, &st)
		if err == nil && st.Type == unix.BPF_FS_MAGIC {
			return nil
		}
		if err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("statfs %s: %w", dir, err)
		}
		switch {
		case err == nil && dir == filepath.Clean(pinPath):
			return fmt.Errorf("pin path %s exists but is not on a bpf filesystem (in a pod: mount the node's %s/topolb there; on a node: mount -t bpf bpf %s)", pinPath, root, root)
		case err == nil && dir == filepath.Clean(root):
			if err := unix.Mount("bpf", root, "bpf", 0, "mode=0700"); err != nil {
				return fmt.Errorf("mount bpffs at %s for pin path %s: %w", root, pinPath, err)
			}
			log.Info("mounted bpf filesystem", "path", root)
			return nil
		case err == nil:
			return fmt.Errorf("pin path %s: %s is not on a bpf filesystem", pinPath, dir)
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return fmt.Errorf("pin path %s: no existing directory on its path", pinPath)
		}
		dir = parent
	}
}
