// Command topolb-demo shows where topolb sends a client's requests. It
// stands up a 3-zone, 6-node testbed out of network namespaces
// (tools/testbed/examples/demo.yaml), runs topolb-agent on every node, and
// for each scenario of the spec sends requests over HTTP and UDP from the
// client on node-a1 (to the cluster IP or its node's NodePort) or from a
// client outside the cluster (to a node's NodePort), then prints where
// they landed, the source address each backend saw, and the mode
// `explain` reports. Then it does the same on a dual-stack testbed
// (tools/testbed/examples/dual-stack.yaml), where one Service's two IP
// families decide different modes, from the client pod and from node-a1's
// own processes, in both families; a family the datapath does not serve
// yet in an expectation's scope (IPv6 from outside) is explained and said
// to be skipped. It needs root and tears everything down on exit and on
// Ctrl-C.
//
//	topolb-demo [--agent-binary bin/topolb-agent] [--datapath agent|direct] [--requests 300] [-v N]
//
// KUBE=1 (or --kube) serves the cluster from a real kube-apiserver
// (`make kube-bins`) instead of a manifest file. -v is klog's verbosity, as
// in the agents it starts and Kubernetes components.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/agent"
	"github.com/topolb/topolb/internal/kubetest"
	"github.com/topolb/topolb/internal/logging"
	"github.com/topolb/topolb/tools/testbed"
	"github.com/topolb/topolb/topology"
)

type config struct {
	specFile  string
	datapath  string
	agentBin  string
	requests  int
	kube      bool
	logging   *logging.Options
	keepGoing bool
}

func main() {
	var c config
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := newCommand(&c).ExecuteContext(ctx)
	if errors.Is(err, context.Canceled) {
		fmt.Fprintln(os.Stderr, "interrupted; everything was torn down")
		os.Exit(130)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

// newCommand returns the demo's command with its flags bound to c.
func newCommand(c *config) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "topolb-demo",
		Short: "Show where topolb sends a client's requests, scenario by scenario, on a testbed of network namespaces",
		Long: `topolb-demo stands up a 3-zone, 6-node testbed out of network namespaces,
runs topolb-agent on every node, and for each scenario of the spec sends
requests over HTTP and UDP from a client pod (to the cluster IP or its
node's NodePort) or from a client outside the cluster (to a node's
NodePort), then prints where they landed, the source address each backend
saw, and the mode 'topolbctl explain' reports, and checks that they agree.
Without --spec it then does the same on a dual-stack testbed, where one
Service's IPv4 and IPv6 decide different modes, sending both families from
the client pod and from a node's own processes to the cluster IP; the
traffic of a family the datapath does not serve yet where it goes (IPv6
from outside) is not sent, and it says so.
It needs root and tears everything down on exit and on Ctrl-C.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		Args:          cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return run(cmd.Context(), cmd.OutOrStdout(), *c)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&c.specFile, "spec", "", "testbed spec with scenarios (default: the built-in demo, tools/testbed/examples/demo.yaml, then its dual-stack part, dual-stack.yaml)")
	fl.StringVar(&c.datapath, "datapath", "", "who programs the nodes: agent (topolb-agent on every node) or direct (this process, through maps/); default agent when the binary exists")
	fl.StringVar(&c.agentBin, "agent-binary", "", "topolb-agent binary (default: next to this binary, else bin/topolb-agent)")
	fl.IntVar(&c.requests, "requests", 300, "requests per scenario and protocol")
	fl.BoolVar(&c.kube, "kube", os.Getenv("KUBE") == "1", "serve the cluster from a real kube-apiserver (also KUBE=1)")
	c.logging = logging.AddFlags(fl)
	fl.Lookup("v").Usage = "log verbosity, klog's as in Kubernetes components, of this command and the agents it starts (their --v); the testbed's info lines show from -v 2"
	return cmd
}

func run(ctx context.Context, out io.Writer, c config) error {
	start := time.Now()
	if os.Geteuid() != 0 {
		return errors.New("needs root: it creates network namespaces and loads BPF programs (try: sudo make demo)")
	}
	specs, err := loadSpecs(c.specFile)
	if err != nil {
		return err
	}
	if err := chooseDatapath(&c, out); err != nil {
		return err
	}
	log, err := c.logging.Apply()
	if err != nil {
		return err
	}
	if c.logging.Verbosity() < 2 {
		log = logging.AtLeast(log, slog.LevelWarn)
	}
	failed, total := 0, 0
	for _, spec := range specs {
		f, err := runSpec(ctx, out, c, spec, log)
		if err != nil {
			return err
		}
		failed += f
		total += len(spec.Scenarios)
	}
	fmt.Fprintf(out, "\n%d of %d scenarios landed exactly where explain said, in %.1fs.\n", total-failed, total, time.Since(start).Seconds())
	if failed > 0 {
		return fmt.Errorf("%d scenarios did not match", failed)
	}
	return nil
}

// runSpec stands up spec's testbed, runs its scenarios and tears it down;
// it returns how many scenarios did not land where explain said, after
// printing the agents' last log lines when any did not.
func runSpec(ctx context.Context, out io.Writer, c config, spec *testbed.Spec, log *slog.Logger) (failed int, err error) {
	tb, err := testbed.New(ctx, spec, testbed.Options{Logger: log})
	if err != nil {
		return 0, err
	}
	var cluster *kubetest.Cluster
	defer func() {
		// Agents first, so the apiserver has no watches to drain.
		if cerr := tb.Close(); cerr != nil {
			err = errors.Join(err, fmt.Errorf("teardown: %w", cerr))
		}
		if cluster != nil {
			if cerr := cluster.Close(); cerr != nil {
				err = errors.Join(err, fmt.Errorf("teardown: %w", cerr))
			}
		}
	}()
	stack := "IPv4"
	if spec.DualStack {
		stack = "dual stack (IPv4 and IPv6)"
	}
	fmt.Fprintf(out, "\ntestbed %s (%s): %d zones, %d nodes, %d pods, %s (namespaces %s%s-*)\n", tb.ID, spec.Name, len(spec.Zones), len(tb.Nodes), len(tb.Pods), stack, testbed.Prefix, tb.ID)

	if c.kube {
		if cluster, err = startAPIServer(ctx, out, tb, spec.DualStack); err != nil {
			return 0, err
		}
	}
	if err := startDatapath(ctx, out, tb, c); err != nil {
		return 0, err
	}
	served, err := tb.ProgrammedFamilies(ctx)
	if err != nil {
		return 0, err
	}
	if spec.DualStack {
		fmt.Fprintf(out, "the datapath serves %s (what the %s says it programs; internal: pods and the node's processes, external: from outside through the uplinks)\n", served, c.datapath)
	}
	failed, err = runScenarios(ctx, out, tb, c, spec, served)
	if err != nil {
		return failed, err
	}
	if failed > 0 {
		for _, a := range tb.Agents() {
			fmt.Fprintf(out, "\n--- last lines of %s\n%s\n", a.LogPath, a.LogTail(15))
		}
	}
	return failed, nil
}

// startAPIServer runs etcd and a kube-apiserver (with an IPv6 service
// range too for a dual-stack testbed) and connects tb's nodes to it; the
// caller closes the returned cluster.
func startAPIServer(ctx context.Context, out io.Writer, tb *testbed.Testbed, dualStack bool) (*kubetest.Cluster, error) {
	fmt.Fprintln(out, "starting etcd and kube-apiserver ...")
	t0 := time.Now()
	var opts []kubetest.Option
	if dualStack {
		opts = append(opts, kubetest.WithDualStackServices())
	}
	cluster, err := kubetest.Run(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("real apiserver (KUBE=1): %w", err)
	}
	if err := tb.ConnectAPIServer(ctx, cluster.Config); err != nil {
		return cluster, err
	}
	fmt.Fprintf(out, "kube-apiserver ready at %s in %.1fs; the cluster objects live there, agents watch it through a relay in each node\n", cluster.URL, time.Since(t0).Seconds())
	return cluster, nil
}

// startDatapath programs tb's datapath as c.datapath says: an agent on
// every node, or this process directly.
func startDatapath(ctx context.Context, out io.Writer, tb *testbed.Testbed, c config) error {
	switch c.datapath {
	case "agent":
		t0 := time.Now()
		if _, err := tb.StartAgents(ctx, testbed.AgentOptions{Binary: c.agentBin, Verbosity: c.logging.Verbosity()}); err != nil {
			return err
		}
		mode := "--from-file " + tb.ManifestPath()
		if c.kube {
			mode = "--kubeconfig (apiserver)"
		}
		fmt.Fprintf(out, "topolb-agent ready on all %d nodes in %.1fs (%s)\n", len(tb.Nodes), time.Since(t0).Seconds(), mode)
	case "direct":
		if _, err := tb.AttachDirect(); err != nil {
			return err
		}
		fmt.Fprintln(out, "datapath programmed from this process (no agent)")
	}
	return nil
}

// runScenarios runs spec's scenarios in order and returns how many did not
// land where explain said; an error stops the run.
func runScenarios(ctx context.Context, out io.Writer, tb *testbed.Testbed, c config, spec *testbed.Spec, served agent.ScopeFamilies) (int, error) {
	failed := 0
	for i, sc := range spec.Scenarios {
		ok, err := runScenario(ctx, out, tb, c, i+1, len(spec.Scenarios), sc.Name, served)
		if err != nil {
			return failed, err
		}
		if !ok {
			failed++
		}
	}
	return failed, nil
}

// loadSpecs returns the spec at path, or without one the built-in demo
// and its dual-stack part, each run on its own testbed.
func loadSpecs(path string) ([]*testbed.Spec, error) {
	if path != "" {
		s, err := testbed.LoadSpec(path)
		return []*testbed.Spec{s}, err
	}
	var out []*testbed.Spec
	for _, load := range []func() (*testbed.Spec, error){testbed.DemoSpec, testbed.DualStackSpec} {
		s, err := load()
		if err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, nil
}

// chooseDatapath settles --datapath and --agent-binary: the agent when its
// binary is there, else the in-process datapath, said out loud.
func chooseDatapath(c *config, out io.Writer) error {
	if c.agentBin == "" {
		c.agentBin = "bin/topolb-agent"
		if exe, err := os.Executable(); err == nil {
			if p := filepath.Join(filepath.Dir(exe), "topolb-agent"); fileExists(p) {
				c.agentBin = p
			}
		}
	}
	switch c.datapath {
	case "":
		c.datapath = "agent"
		if !fileExists(c.agentBin) {
			fmt.Fprintf(out, "note: no agent binary at %s; programming the datapath from this process instead\n", c.agentBin)
			c.datapath = "direct"
		}
	case "agent":
		if !fileExists(c.agentBin) {
			return fmt.Errorf("no agent binary at %s (make build)", c.agentBin)
		}
	case "direct":
	default:
		return fmt.Errorf("--datapath %q: want agent or direct", c.datapath)
	}
	if c.kube && c.datapath != "agent" {
		return errors.New("KUBE=1 needs the agent: only it watches the apiserver")
	}
	return nil
}

func fileExists(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && !fi.IsDir()
}

// runScenario applies one scenario, waits for the agents to agree with
// explain, sends the requests of every expectation and prints the tables.
// It reports whether every landing matched both explain and the spec.
func runScenario(ctx context.Context, out io.Writer, tb *testbed.Testbed, c config, i, n int, name string, served agent.ScopeFamilies) (bool, error) {
	var wait func() error
	if c.datapath == "agent" {
		wait = func() error { return tb.WaitAgents(ctx, 15*time.Second) }
	}
	// Each scenario shows where new flows go: the previous scenario's
	// flows are forgotten first (a reused UDP source port would keep its
	// draining backend); a drain scenario opens its stream before the
	// change.
	sc, stream, err := tb.EnterScenario(ctx, name, wait)
	if err != nil {
		spec, _ := tb.Spec.Scenario(name)
		title := name
		if spec != nil {
			title = spec.Title
		}
		fmt.Fprintf(out, "\n[%d/%d] %s\n      %s\n      ✗ %v\n", i, n, name, title, err)
		return false, nil
	}
	fmt.Fprintf(out, "\n[%d/%d] %s\n      %s\n", i, n, sc.Name, sc.Title)
	drained := true
	if stream != nil {
		d := sc.Drain
		err := testbed.StreamStays(ctx, stream, d.Pod, 10)
		stream.Close()
		if err != nil {
			fmt.Fprintf(out, "      ✗ %v\n", err)
			drained = false
		} else {
			fmt.Fprintf(out, "      ✓ a keep-alive stream opened on %s before the change answered 10 of 10 requests from it afterwards\n", d.Pod)
		}
	}
	ok := drained
	for _, e := range sc.Expect {
		scope := tb.Scope(e)
		if e.Family != "" && !served.Programs(e.Family, scope) {
			explainUnserved(out, tb, e, scope, served)
			continue
		}
		landings, node, err := tb.MeasureExpectation(ctx, e, testbed.MeasureOptions{Requests: c.requests, Parallel: 100, Timeout: time.Second, Families: served[scope]})
		if err != nil {
			return false, err
		}
		d := landings[0].Decision
		switch {
		case e.Via != "":
			fmt.Fprintf(out, "      %s -> %s's NodePorts (%s)\n", e.Client, node, d.NodePort.Addr())
		case tb.Pod(e.Client) == nil:
			fmt.Fprintf(out, "      %s's own processes (host network) -> the cluster IP (%s)\n", e.Client, d.Frontend.Addr())
		}
		family := ""
		if tb.Spec.DualStack {
			family = ", family " + string(d.Family)
		}
		fmt.Fprintf(out, "      explain --node %s --service %s%s: policy %s, mode %s\n      reason: %s\n\n", node, d.Service, family, d.Policy, d.Mode, d.Reason)
		printTable(out, tb, landings, e.Via != "")
		want := slices.Clone(e.Backends)
		slices.Sort(want)
		for _, l := range landings {
			problems := l.Problems()
			if !slices.Equal(l.Decision.Backends, want) {
				problems = append(problems, fmt.Sprintf("explain permits %v but the spec expects %v", l.Decision.Backends, want))
			}
			label := portLabel(l, e.Via != "")
			switch {
			case len(problems) > 0:
				ok = false
				fmt.Fprintf(out, "      ✗ %s: %s\n", label, strings.Join(problems, "; "))
			case len(want) == 0:
				fmt.Fprintf(out, "      ✓ %s: all %d requests dropped (%s), as explain says: no backend is permitted\n", label, l.Tally.Failed, strings.Join(l.Tally.Errors, ", "))
			case l.Decision.Weights != nil:
				fmt.Fprintf(out, "      ✓ %s: every backend's share is its weight within tolerance: %s\n", label, shares(l))
			default:
				fmt.Fprintf(out, "      ✓ %s: every request landed on a permitted backend, and every permitted backend got some: %s\n", label, strings.Join(want, " "))
			}
		}
		if e.Via != "" && len(want) > 0 {
			fmt.Fprintf(out, "        backends saw: %s\n", sources(tb, landings))
		}
	}
	return ok, nil
}

// explainUnserved prints what explain decides for an expectation in a
// family the datapath does not serve in its scope (served), and says
// plainly that its traffic is not sent.
func explainUnserved(out io.Writer, tb *testbed.Testbed, e testbed.Expectation, scope topology.Scope, served agent.ScopeFamilies) {
	node := tb.HeldTo(e)
	objs, _ := tb.Current()
	ds, _ := tb.Decide(objs, node)
	for _, proto := range []v1.Protocol{v1.ProtocolTCP, v1.ProtocolUDP} {
		d := testbed.FindDecisionOf(ds, e.Service, proto, e.Family)
		if d == nil {
			continue
		}
		fmt.Fprintf(out, "      explain --node %s --service %s, family %s: policy %s, mode %s, %s permits %v\n      reason: %s\n", node, d.Service, e.Family, d.Policy, d.Mode, proto, d.Backends, d.Reason)
	}
	fmt.Fprintf(out, "      – %s traffic not sent: this datapath does not serve %s in scope %s yet (it programs %s)\n\n", e.Family, e.Family, scope, served)
}

// sources says, per backend, which source address it saw: the client's
// own, or a node's (the flow was source-translated there).
func sources(tb *testbed.Testbed, landings []testbed.Landing) string {
	seen := map[string]map[netip.Addr]bool{}
	client := landings[0].Client
	for _, l := range landings {
		for pod, addrs := range l.Tally.Sources {
			if seen[pod] == nil {
				seen[pod] = map[netip.Addr]bool{}
			}
			for a := range addrs {
				seen[pod][a] = true
			}
		}
	}
	nodeOf := map[netip.Addr]string{}
	for _, n := range tb.Nodes {
		nodeOf[n.WireAddr.Addr()] = n.Name
		if n.WireAddr6.IsValid() {
			nodeOf[n.WireAddr6.Addr()] = n.Name
		}
	}
	var parts []string
	for _, pod := range slices.Sorted(maps.Keys(seen)) {
		for _, a := range slices.SortedFunc(maps.Keys(seen[pod]), netip.Addr.Compare) {
			who := "another address"
			switch {
			case a == client.ClientAddrOf(v1.IPv4Protocol) || a == client.ClientAddrOf(v1.IPv6Protocol):
				who = client.ClientName() + "'s own"
			case nodeOf[a] != "":
				who = nodeOf[a] + "'s, source-translated"
			}
			parts = append(parts, fmt.Sprintf("%s <- %s (%s)", pod, a, who))
		}
	}
	return strings.Join(parts, ", ")
}

// portLabel names the port a landing was measured on: "TCP/80", or the
// nodePort when the client went through a node's NodePorts.
func portLabel(l testbed.Landing, nodePort bool) string {
	port := l.Decision.Frontend.Port()
	if nodePort {
		port = l.Decision.NodePort.Port()
	}
	return fmt.Sprintf("%s/%d", l.Decision.Protocol, port)
}

// printTable prints one row per backend that answered: its node, zone and
// counts per port, and a row of failures.
func printTable(out io.Writer, tb *testbed.Testbed, landings []testbed.Landing, nodePort bool) {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	header := "      BACKEND\tNODE\tZONE"
	for _, l := range landings {
		header += "\t" + portLabel(l, nodePort)
	}
	fmt.Fprintln(w, header)
	var pods []string
	for _, l := range landings {
		for _, p := range l.Tally.Backends() {
			if !slices.Contains(pods, p) {
				pods = append(pods, p)
			}
		}
	}
	slices.Sort(pods)
	for _, name := range pods {
		node, zone := "?", "?"
		if p := tb.Pod(name); p != nil {
			node, zone = p.Node.Name, p.Zone()
		}
		row := fmt.Sprintf("      %s\t%s\t%s", name, node, zone)
		for _, l := range landings {
			row += fmt.Sprintf("\t%d", l.Tally.Landed[name])
		}
		fmt.Fprintln(w, row)
	}
	anyFailed := false
	row := "      (failed)\t\t"
	for _, l := range landings {
		row += fmt.Sprintf("\t%d", l.Tally.Failed)
		anyFailed = anyFailed || l.Tally.Failed > 0
	}
	if anyFailed {
		fmt.Fprintln(w, row)
	}
	w.Flush()
	fmt.Fprintln(out)
}

// shares renders "web-a1 60% (got 58%), ..." for weighted landings.
func shares(l testbed.Landing) string {
	answered := 0
	for _, n := range l.Tally.Landed {
		answered += n
	}
	var parts []string
	for _, b := range slices.Sorted(maps.Keys(l.Decision.Weights)) {
		parts = append(parts, fmt.Sprintf("%s %.0f%% (got %.0f%%)", b, 100*l.Decision.Weights[b], 100*float64(l.Tally.Landed[b])/float64(max(answered, 1))))
	}
	return strings.Join(parts, ", ")
}
