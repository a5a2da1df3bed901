package testbed

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/agent"
	dpmaps "github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

// Addresses the agents listen on inside their node's namespace; every node
// has its own loopback, so all agents use the same ones.
const (
	AgentMetricsAddress = "127.0.0.1:9965"
	AgentHealthAddress  = "127.0.0.1:9966"
	// AgentProxyHealthAddress is the agent's --healthz-bind-address: not
	// kube-proxy's port, since tests run kube-proxy beside the agent
	// (KubeProxyHealthAddress).
	AgentProxyHealthAddress = "127.0.0.1:10266"
)

// AgentOptions configure the agents the testbed runs.
type AgentOptions struct {
	// Binary is the topolb-agent executable.
	Binary string
	// Verbosity is passed as -v.
	Verbosity int
	// Map sizes (--max-frontends, --max-backends, --max-conntrack). Zero
	// selects the testbed's small defaults, which load in a fraction of
	// the time the agent's production defaults take.
	MaxFrontends, MaxBackends, MaxConntrack uint32
	// Args are appended to the command line.
	Args []string
	// Options are the decision options Args select (--nodeport-addresses,
	// --cluster-ips-from-outside), which WaitAgents expects the maps to
	// follow; nil: topology.DefaultOptions.
	Options *topology.Options
}

// Map sizes agents get in the testbed unless AgentOptions say otherwise.
const (
	TestbedMaxFrontends = 4096
	TestbedMaxBackends  = 16384
	TestbedMaxConntrack = 65536
)

// Agent is a topolb-agent process running in a node's namespace, started
// with `nsenter --net=<node ns> topolb-agent --from-file <manifest>` (or
// --kubeconfig in apiserver mode). Its log is appended to LogPath across
// restarts.
type Agent struct {
	*Process
	opts AgentOptions
	http *http.Client
}

// StartAgents starts an agent on every node and waits until all are ready.
func (tb *Testbed) StartAgents(ctx context.Context, o AgentOptions) ([]*Agent, error) {
	var agents []*Agent
	for _, n := range tb.Nodes {
		a, err := tb.StartAgent(ctx, n.Name, o)
		if err != nil {
			return nil, err
		}
		agents = append(agents, a)
	}
	for _, a := range agents {
		if err := a.WaitReady(ctx); err != nil {
			return nil, err
		}
	}
	return agents, nil
}

// StartAgent starts an agent on the named node and returns without waiting
// for it to be ready. The testbed stops it on Close.
func (tb *Testbed) StartAgent(ctx context.Context, node string, o AgentOptions) (*Agent, error) {
	n := tb.Node(node)
	if n == nil {
		return nil, fmt.Errorf("no node %q", node)
	}
	if o.Binary == "" {
		return nil, errors.New("no agent binary given")
	}
	bin, err := filepath.Abs(o.Binary)
	if err != nil {
		return nil, err
	}
	o.Binary = bin
	o.MaxFrontends = cmp.Or(o.MaxFrontends, TestbedMaxFrontends)
	o.MaxBackends = cmp.Or(o.MaxBackends, TestbedMaxBackends)
	o.MaxConntrack = cmp.Or(o.MaxConntrack, TestbedMaxConntrack)
	a := &Agent{
		Process: newNodeProcess(tb, n, "agent", o.Binary),
		opts:    o,
		http: &http.Client{
			Timeout:   5 * time.Second,
			Transport: &http.Transport{DialContext: n.NS.DialContext, DisableKeepAlives: true},
		},
	}
	a.args = a.Args
	tb.mu.Lock()
	switch {
	case tb.closed:
		err = errors.New("testbed closed")
	case tb.direct != nil:
		err = errors.New("the in-process datapath is attached: close it before starting agents")
	case slices.ContainsFunc(tb.agents, func(o *Agent) bool { return o.Node == n }):
		err = fmt.Errorf("node %s already has an agent", node)
	default:
		tb.agents = append(tb.agents, a)
	}
	tb.mu.Unlock()
	if err != nil {
		return nil, err
	}
	if err := a.Start(ctx); err != nil {
		return nil, err
	}
	return a, nil
}

// Args returns the agent's command line after the binary.
func (a *Agent) Args() []string {
	args := []string{
		"--node-name", a.Node.Name,
		"--pod-interfaces", "auto",
		"--uplinks", "auto",
		"--bpffs", a.tb.BPFFS(a.Node.Name),
		"--metrics-address", AgentMetricsAddress,
		"--health-address", AgentHealthAddress,
		"--healthz-bind-address", AgentProxyHealthAddress,
		"--max-frontends", strconv.FormatUint(uint64(a.opts.MaxFrontends), 10),
		"--max-backends", strconv.FormatUint(uint64(a.opts.MaxBackends), 10),
		"--max-conntrack", strconv.FormatUint(uint64(a.opts.MaxConntrack), 10),
		"-v", strconv.Itoa(a.opts.Verbosity),
	}
	if kc := a.tb.kubeconfigFor(a.Node.Name); kc != "" {
		// Every Node, as explain reads them, which the e2e tests compare
		// the agents with from the first sync on; the topology summary's
		// path (--node-watch=own) has its apiserver test in agent/.
		args = append(args, "--kubeconfig", kc, "--node-watch", "all")
	} else {
		args = append(args, "--from-file", a.tb.ManifestPath())
	}
	return append(args, a.opts.Args...)
}

// get GETs a path of the agent's health endpoint from inside the node.
func (a *Agent) get(ctx context.Context, path string) ([]byte, int, error) {
	return a.getAt(ctx, AgentHealthAddress, path)
}

// Metrics reads the agent's /metrics, in Prometheus' text format.
func (a *Agent) Metrics(ctx context.Context) (string, error) {
	body, code, err := a.getAt(ctx, AgentMetricsAddress, "/metrics")
	if err != nil {
		return "", fmt.Errorf("agent on %s: metrics: %w", a.Node.Name, err)
	}
	if code != http.StatusOK {
		return "", fmt.Errorf("agent on %s: metrics: status %d: %.200s", a.Node.Name, code, body)
	}
	return string(body), nil
}

// getAt GETs path at addr from inside the node.
func (a *Agent) getAt(ctx context.Context, addr, path string) ([]byte, int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+path, nil)
	if err != nil {
		return nil, 0, err
	}
	resp, err := a.http.Do(req)
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	return body, resp.StatusCode, err
}

// DefaultAgentReadyTimeout is how long WaitReady waits for an agent unless
// AgentReadyTimeoutEnv says otherwise.
const DefaultAgentReadyTimeout = 60 * time.Second

// AgentReadyTimeoutEnv names the environment variable that sets how long
// WaitReady waits for an agent (a Go duration, "5m"): the kernel matrix
// sets it under TCG (tools/kernels/run.sh), where probing the kernel and
// verifying the programs takes minutes.
const AgentReadyTimeoutEnv = "TOPOLB_AGENT_READY_TIMEOUT"

// AgentReadyTimeout is WaitReady's limit: AgentReadyTimeoutEnv, else
// DefaultAgentReadyTimeout. Callers that bound an agent's start with a
// context of their own give it at least this.
func AgentReadyTimeout() (time.Duration, error) {
	v := os.Getenv(AgentReadyTimeoutEnv)
	if v == "" {
		return DefaultAgentReadyTimeout, nil
	}
	d, err := time.ParseDuration(v)
	if err == nil && d <= 0 {
		err = errors.New("not positive")
	}
	if err != nil {
		return 0, fmt.Errorf("%s=%q: want a positive duration such as 5m: %w", AgentReadyTimeoutEnv, v, err)
	}
	return d, nil
}

// ScaleTimeout scales d, a bound a test sets for a real machine, by how
// much slower the environment says it is: AgentReadyTimeout over
// DefaultAgentReadyTimeout (10 times under TCG in the kernel matrix),
// never below d, so on a real machine d is unchanged.
func ScaleTimeout(d time.Duration) (time.Duration, error) {
	limit, err := AgentReadyTimeout()
	if err != nil || limit <= DefaultAgentReadyTimeout {
		return d, err
	}
	return time.Duration(float64(d) * float64(limit) / float64(DefaultAgentReadyTimeout)), nil
}

// WaitReady waits until GET /readyz answers 200: the agent has written its
// first full sync to the maps. It fails at once if the process exits, and
// after AgentReadyTimeout or when ctx ends.
func (a *Agent) WaitReady(ctx context.Context) error {
	limit, err := AgentReadyTimeout()
	if err != nil {
		return err
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	done := a.doneChan()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	var last error
	for {
		_, code, err := a.get(ctx, "/readyz")
		if err == nil && code == http.StatusOK {
			return nil
		}
		if err == nil {
			err = fmt.Errorf("status %d", code)
		}
		last = err
		select {
		case <-done:
			return fmt.Errorf("agent on %s exited before it was ready (%v); last log lines:\n%s", a.Node.Name, a.ExitError(), a.LogTail(20))
		case <-ctx.Done():
			return fmt.Errorf("agent on %s not ready after %v (limit %v, %s): %w (last: %v); last log lines:\n%s",
				a.Node.Name, time.Since(start).Round(time.Second), limit, AgentReadyTimeoutEnv, ctx.Err(), last, a.LogTail(20))
		case <-tick.C:
		}
	}
}

// AgentState is the agent's GET /debug/state: its current decisions, in
// the JSON of `topolbctl explain -o json`, plus what it programmed.
type AgentState struct {
	agent.DebugState
	// Raw is the whole document, including fields this type does not
	// know.
	Raw json.RawMessage `json:"-"`
}

// State reads the agent's current decisions.
func (a *Agent) State(ctx context.Context) (*AgentState, error) {
	body, code, err := a.get(ctx, "/debug/state")
	if err != nil {
		return nil, fmt.Errorf("agent on %s: debug state: %w", a.Node.Name, err)
	}
	if code != http.StatusOK {
		return nil, fmt.Errorf("agent on %s: debug state: status %d: %.200s", a.Node.Name, code, body)
	}
	st := &AgentState{Raw: body}
	if err := json.Unmarshal(body, st); err != nil {
		return nil, fmt.Errorf("agent on %s: decode debug state: %w", a.Node.Name, err)
	}
	return st, nil
}

// Mismatch compares the agent's decisions, and the backends its maps hold
// for each cluster IP, with what DecideNode decides for its node on the
// testbed's current objects, and describes the first difference ("" when
// they agree).
func (a *Agent) Mismatch(st *AgentState) string {
	if !st.Synced {
		return "agent has not synced yet"
	}
	objs, _ := a.tb.Current()
	want, _ := a.tb.Decide(objs, a.Node.Name)
	got := map[string][]string{}
	for _, s := range st.Services {
		// An agent older than dual stack does not say: it decides IPv4.
		family := cmp.Or(s.Family, v1.IPv4Protocol)
		got[s.Service+"/"+s.Port+"/"+s.Protocol+"/"+string(family)] = s.Backends
	}
	for _, d := range want {
		key := d.Service + "/" + d.Port + "/" + string(d.Protocol) + "/" + string(d.Family)
		g, ok := got[key]
		if !ok {
			return fmt.Sprintf("%s: agent has no decision", key)
		}
		if !slices.Equal(sorted(g), d.Addrs) {
			return fmt.Sprintf("%s: agent decides %v, DecideNode %v", key, g, d.Addrs)
		}
		delete(got, key)
	}
	for key := range got {
		return fmt.Sprintf("%s: agent decides a port that does not exist", key)
	}
	opts := topology.DefaultOptions()
	if a.opts.Options != nil {
		opts = *a.opts.Options
	}
	return frontendMismatch(desiredFrontends(objs.State(nil), a.Node.Name, opts, st.ProgrammedFamilies()), st.Datapath)
}

// slotShareTolerance is how far a backend's share of its frontend's slots
// may be from its share of the weights: the slot table's apportionment
// error (under one slot of at least 512) with room to spare, and far below
// any difference between two policies' weights.
const slotShareTolerance = 0.01

// shareMismatch compares the active backends' weights (0 means 1) with
// their slot counts as the maps hold them (slots, keyed "ip:port") and
// says which backend's share differs by more than slotShareTolerance (""
// when none does). Without it, a change of weights alone (the same
// backends, as from Hints giving up to ZoneWeighted) would look applied
// before the agent has written it.
func shareMismatch(backends []dpmaps.Backend, slots map[string]uint32) string {
	var wSum, sSum float64
	for _, b := range backends {
		if b.Draining {
			continue
		}
		wSum += float64(max(b.Weight, 1))
		sSum += float64(slots[b.Addr.String()])
	}
	if wSum == 0 || sSum == 0 {
		return ""
	}
	for _, b := range backends {
		if b.Draining {
			continue
		}
		want := float64(max(b.Weight, 1)) / wSum
		got := float64(slots[b.Addr.String()]) / sSum
		if math.Abs(want-got) > slotShareTolerance {
			return fmt.Sprintf("%s has %.1f%% of the slots, weight %.1f%%", b.Addr, 100*got, 100*want)
		}
	}
	return ""
}

// frontendMismatch compares the frontends an agent should program (want,
// from the functions the agent programs through) with what its maps hold,
// read back from the kernel, and says how they differ ("" when they agree).
func frontendMismatch(want map[dpmaps.Frontend]dpmaps.Service, got map[string]agent.ProgrammedFrontend) string {
	programmed := maps.Clone(got)
	for fe, svc := range want {
		var active, draining []string
		for _, b := range svc.Backends {
			if b.Draining {
				draining = append(draining, b.Addr.String())
			} else {
				active = append(active, b.Addr.String())
			}
		}
		p, ok := programmed[fe.String()]
		switch {
		case !ok:
			return fmt.Sprintf("frontend %s not programmed", fe)
		case !slices.Equal(sorted(p.Backends), sorted(active)):
			return fmt.Sprintf("maps hold %v for %s, DecideNode %v", p.Backends, fe, sorted(active))
		case !subset(p.DrainingBackends, draining):
			// A backend that was never active here has no flows to keep:
			// the datapath does not program it as draining.
			return fmt.Sprintf("maps hold draining %v for %s, DecideNode at most %v", p.DrainingBackends, fe, sorted(draining))
		case len(p.Problems) > 0:
			return fmt.Sprintf("maps are inconsistent for %s: %v", fe, p.Problems)
		}
		if m := shareMismatch(svc.Backends, p.Slots); m != "" {
			return fmt.Sprintf("maps hold other weights for %s: %s", fe, m)
		}
		delete(programmed, fe.String())
	}
	for fe := range programmed {
		return fmt.Sprintf("frontend %s is programmed but no service has it", fe)
	}
	return ""
}

// subset reports whether every element of a is in b.
func subset(a, b []string) bool {
	for _, x := range a {
		if !slices.Contains(b, x) {
			return false
		}
	}
	return true
}

func sorted(ss []string) []string {
	out := slices.Clone(ss)
	slices.Sort(out)
	return out
}

// WaitAgents waits until every agent the testbed started agrees with
// DecideNode for its node on the objects last applied (decisions and map
// contents). An agent that is not running — it crashed, or a test stopped
// it and did not start it again — fails the wait at once: an agent that
// cannot answer has not converged.
func (tb *Testbed) WaitAgents(ctx context.Context, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tb.mu.Lock()
	agents := slices.Clone(tb.agents)
	tb.mu.Unlock()
	for _, a := range agents {
		var last string
		for {
			if !a.Running() {
				return fmt.Errorf("agent on %s is not running (%v); last log lines:\n%s", a.Node.Name, a.ExitError(), a.LogTail(20))
			}
			st, err := a.State(ctx)
			if err != nil {
				last = err.Error()
			} else if last = a.Mismatch(st); last == "" {
				break
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("agent on %s did not converge: %s", a.Node.Name, last)
			case <-time.After(20 * time.Millisecond):
			}
		}
	}
	return nil
}

// ProgrammedFamilies returns the IP families every node's datapath
// programs per scope, as it says itself: each agent's /debug/state
// (AgentState.ProgrammedFamilies), or what the in-process datapath serves
// (maps.Datapath.IPv6, as the agent reads it). A family missing in a
// scope on one node is left out of that scope. Without agents or the
// in-process datapath there is none.
func (tb *Testbed) ProgrammedFamilies(ctx context.Context) (agent.ScopeFamilies, error) {
	tb.mu.Lock()
	agents, direct := slices.Clone(tb.agents), tb.direct
	tb.mu.Unlock()
	var each []agent.ScopeFamilies
	for _, a := range agents {
		st, err := a.State(ctx)
		if err != nil {
			return nil, err
		}
		each = append(each, st.ProgrammedFamilies())
	}
	if direct != nil {
		for _, dp := range direct.nodes {
			each = append(each, agent.ProgrammedFamilies(dp.IPv6))
		}
	}
	if len(each) == 0 {
		return nil, nil
	}
	out := agent.ScopeFamilies{}
	for scope, families := range each[0] {
		for _, f := range families {
			if !slices.ContainsFunc(each[1:], func(sf agent.ScopeFamilies) bool { return !sf.Programs(f, scope) }) {
				out[scope] = append(out[scope], f)
			}
		}
	}
	return out, nil
}

// Agents returns the agents the testbed started.
func (tb *Testbed) Agents() []*Agent {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	return slices.Clone(tb.agents)
}

// Agent returns the agent of the named node, or nil.
func (tb *Testbed) Agent(node string) *Agent {
	for _, a := range tb.Agents() {
		if a.Node.Name == node {
			return a
		}
	}
	return nil
}

// UseBinary makes the agent's next Start run bin instead, as an upgrade
// replaces the binary between a stop and a start. It fails while the
// agent runs.
func (a *Agent) UseBinary(bin string) error {
	abs, err := filepath.Abs(bin)
	if err != nil {
		return err
	}
	if a.Running() {
		return fmt.Errorf("agent on %s is running: stop it before changing its binary", a.Node.Name)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.binary, a.opts.Binary = abs, abs
	return nil
}
