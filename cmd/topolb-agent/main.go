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
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"
	"k8s.io/client-go/kubernetes"

	"github.com/topolb/topolb/agent"
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
	bpffs          string
	metricsAddress string
	healthAddress  string
	maxFrontends   uint32
	maxBackends    uint32
	maxConntrack   uint32
	events         bool
	coalesce       time.Duration
	retry          time.Duration
	verbosity      int
}

func main() {
	var f flags
	cmd := &cobra.Command{
		Use:   "topolb-agent",
		Short: "Program this node's topology-aware eBPF load balancer",
		Long: `topolb-agent runs on every node. It watches Services, EndpointSlices and Nodes
(from the cluster, or from a manifest file with --from-file), decides for
this node which backends each service port may use (the same decision as
'topolbctl explain'), and writes only those into pinned BPF maps. The tc
program on pod interfaces and the XDP program on uplinks balance traffic
from them. The datapath is pinned under --bpffs and outlives the agent: a
restart adopts it and never flushes it.`,
		SilenceUsage: true,
		Args:         cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return run(cmd.Context(), f)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.nodeName, "node-name", os.Getenv("NODE_NAME"), "name of this node (default $NODE_NAME)")
	fl.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig file (default: in-cluster configuration, else $KUBECONFIG)")
	fl.StringVar(&f.fromFile, "from-file", "", "standalone mode: read Nodes, Services and EndpointSlices from this manifest file and reload it when it changes")
	fl.StringVar(&f.podInterfaces, "pod-interfaces", "auto", `comma-separated pod (host-side veth) interfaces for the tc program, or "auto": every veth that is not an uplink, followed as they come and go`)
	fl.StringVar(&f.uplinks, "uplinks", "auto", `comma-separated uplink interfaces for the XDP program, or "auto": the devices of the default routes`)
	fl.StringVar(&f.bpffs, "bpffs", maps.DefaultPinPath, "directory on a bpf filesystem where maps and links are pinned")
	fl.StringVar(&f.metricsAddress, "metrics-address", "127.0.0.1:9965", "address serving Prometheus metrics at /metrics (empty disables)")
	fl.StringVar(&f.healthAddress, "health-address", "127.0.0.1:9966", "address serving /healthz, /readyz and /debug/state (empty disables)")
	fl.Uint32Var(&f.maxFrontends, "max-frontends", maps.DefaultMaxFrontends, "capacity of the services map (frontends)")
	fl.Uint32Var(&f.maxBackends, "max-backends", maps.DefaultMaxBackends, "capacity of the backends map (sum of backends over frontends)")
	fl.Uint32Var(&f.maxConntrack, "max-conntrack", maps.DefaultMaxConntrack, "capacity of the LRU conntrack map")
	fl.BoolVar(&f.events, "events", true, "emit Kubernetes Events on Services when this node's mode changes or programming fails (rate-limited)")
	fl.DurationVar(&f.coalesce, "sync-coalesce", 2*time.Millisecond, "wait this long after a change so a burst of changes becomes one sync")
	fl.DurationVar(&f.retry, "retry-interval", time.Second, "how often services whose programming failed are retried")
	fl.IntVarP(&f.verbosity, "v", "v", 0, "log verbosity: 0 operators (mode changes, errors), 1 debug, 4 every map write")

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := cmd.ExecuteContext(ctx); err != nil {
		os.Exit(1)
	}
}

func run(ctx context.Context, f flags) (err error) {
	level := slog.LevelInfo - slog.Level(f.verbosity)*4
	if f.verbosity == 1 {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	if f.nodeName == "" {
		return errors.New("--node-name (or $NODE_NAME) is required")
	}
	if f.fromFile != "" && f.kubeconfig != "" {
		return errors.New("--from-file and --kubeconfig are mutually exclusive")
	}

	var client kubernetes.Interface
	if f.fromFile == "" {
		cfg, err := kube.RESTConfig(f.kubeconfig)
		if err != nil {
			return err
		}
		client, err = kubernetes.NewForConfig(cfg)
		if err != nil {
			return fmt.Errorf("create client: %w", err)
		}
	}

	if err := ensureBPFFS(log, f.bpffs); err != nil {
		return err
	}
	dp, err := maps.Load(maps.Options{
		PinPath: f.bpffs, MaxFrontends: f.maxFrontends, MaxBackends: f.maxBackends, MaxConntrack: f.maxConntrack,
		Logger: log.With("component", "datapath"),
	})
	if err != nil {
		if errors.Is(err, os.ErrPermission) {
			// cilium/ebpf suggests raising MEMLOCK, which is not the
			// cause on kernels that account BPF memory to cgroups.
			return fmt.Errorf("load datapath (the agent needs CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON): %w", err)
		}
		return fmt.Errorf("load datapath: %w", err)
	}
	// Close releases file descriptors only: pinned maps and links keep the
	// datapath serving after the agent exits.
	defer dp.Close()

	uplinks, pods, autoPods, err := agent.ParseInterfaces(f.uplinks, f.podInterfaces)
	if err != nil {
		return err
	}
	ifaces := &agent.Interfaces{DP: dp, Log: log.With("component", "interfaces"), Uplinks: uplinks, Pods: pods, AutoPods: autoPods}
	if err := ifaces.Attach(ctx); err != nil {
		return err
	}

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics := agent.NewMetrics(reg)
	cfg := agent.Config{
		NodeName: f.nodeName, Options: topology.DefaultOptions(),
		Logger: log.With("component", "agent"), Metrics: metrics,
	}
	if client != nil && f.events {
		ev := agent.NewKubeEvents(client, f.nodeName)
		defer ev.Shutdown(context.Background())
		cfg.Events = ev
	}
	a := agent.New(cfg, dp)
	reg.MustRegister(agent.NewDatapathCollector(dp, a.BackendZones))

	if f.metricsAddress != "" {
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		if err := serve(ctx, log, "metrics", f.metricsAddress, mux); err != nil {
			return err
		}
	}
	if f.healthAddress != "" {
		if err := serve(ctx, log, "health", f.healthAddress, a.HealthHandler()); err != nil {
			return err
		}
	}

	tracker := kube.NewTracker()
	if f.fromFile != "" {
		w := &kube.FileWatcher{
			Path: f.fromFile, Tracker: tracker,
			OnLoad: func(warnings []string) {
				log.Info("manifests loaded", "file", f.fromFile)
				for _, w := range warnings {
					log.Warn("manifest", "warning", w)
				}
			},
			OnError: func(err error) {
				log.Error("manifests not loaded; the previous state stays in force", "file", f.fromFile, "err", err)
			},
		}
		go w.Run(ctx)
	} else {
		go func() {
			if err := kube.Watch(ctx, client, tracker); err != nil {
				log.Error("watch cluster", "err", err)
			}
		}()
	}
	log.Info("agent started", "node", f.nodeName, "bpffs", f.bpffs, "uplinks", uplinks, "podInterfaces", f.podInterfaces)
	a.Run(ctx, tracker, f.coalesce, f.retry)
	log.Info("agent stopping; the datapath stays pinned and keeps serving")
	return nil
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

// ensureBPFFS mounts a bpf filesystem at /sys/fs/bpf when pinPath lies under
// it and none is mounted there yet, as a node without systemd's bpffs mount
// needs.
func ensureBPFFS(log *slog.Logger, pinPath string) error {
	const root = "/sys/fs/bpf"
	if pinPath != root && !strings.HasPrefix(pinPath, root+"/") {
		return nil
	}
	var st unix.Statfs_t
	if err := unix.Statfs(root, &st); err != nil {
		return fmt.Errorf("statfs %s: %w", root, err)
	}
	if st.Type == unix.BPF_FS_MAGIC {
		return nil
	}
	if err := unix.Mount("bpf", root, "bpf", 0, "mode=0700"); err != nil {
		return fmt.Errorf("mount bpffs at %s: %w", root, err)
	}
	log.Info("mounted bpf filesystem", "path", root)
	return nil
}
