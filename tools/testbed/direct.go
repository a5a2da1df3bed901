package testbed

import (
	"errors"
	"fmt"

	"github.com/topolb/topolb/agent"
	"github.com/topolb/topolb/kube"
	"github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

// Direct programs every node's datapath from inside this process through
// maps/, straight from topology.State.DecideNode: tc on every pod veth, XDP
// on the uplink, the socket hooks for the node's own processes, and for
// each node the backends its decision permits. It
// stands in for the agent, to tell datapath and decision problems from
// agent problems, and to drive traffic before an agent exists.
type Direct struct {
	tb    *Testbed
	nodes map[string]*maps.Datapath
}

// Map sizes of the in-process datapath: small, so loading is quick.
const (
	directMaxFrontends = 1024
	directMaxBackends  = 8192
	directMaxConntrack = 65536
)

// AttachDirect loads a datapath for every node, pinned under BPFFS(node),
// attaches it and programs the current objects. Apply keeps it programmed
// from then on; Close (or the testbed's Close) unpins it. A node cannot run
// an agent and the in-process datapath at once.
func (tb *Testbed) AttachDirect() (_ *Direct, err error) {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	if tb.direct != nil {
		return nil, errors.New("in-process datapath already attached")
	}
	if len(tb.agents) > 0 {
		return nil, errors.New("agents are running: stop them before attaching the in-process datapath")
	}
	d := &Direct{tb: tb, nodes: map[string]*maps.Datapath{}}
	defer func() {
		if err != nil {
			d.unload()
		}
	}()
	cgroupRoot, err := maps.CgroupRoot("auto")
	if err != nil {
		return nil, err
	}
	for _, n := range tb.Nodes {
		dp, err := maps.Load(maps.Options{
			PinPath:      tb.BPFFS(n.Name),
			NetNS:        n.NS.Path,
			MaxFrontends: directMaxFrontends,
			MaxBackends:  directMaxBackends,
			MaxConntrack: directMaxConntrack,
			Logger:       tb.log.With("node", n.Name),
		})
		if err != nil {
			return nil, fmt.Errorf("node %s: load datapath: %w", n.Name, err)
		}
		d.nodes[n.Name] = dp
		for _, p := range n.Pods {
			if err := dp.AttachPod(p.HostVeth); err != nil {
				return nil, fmt.Errorf("node %s: %w", n.Name, err)
			}
		}
		if err := dp.AttachUplink(UplinkName); err != nil {
			return nil, fmt.Errorf("node %s: %w", n.Name, err)
		}
		if err := dp.AttachHost(cgroupRoot); err != nil {
			return nil, fmt.Errorf("node %s: %w", n.Name, err)
		}
	}
	if tb.objs != nil {
		if err := d.Program(tb.objs); err != nil {
			return nil, err
		}
	}
	tb.direct = d
	return d, nil
}

// Datapath returns the named node's datapath.
func (d *Direct) Datapath(node string) *maps.Datapath { return d.nodes[node] }

// Program writes, on every node, exactly the frontends the decision engine
// assembles for it (topology.NodeFrontends: scopes, kinds, ownership), with
// the datapath settings the agent would write (agent.DatapathService), and
// deletes frontends that are gone.
func (d *Direct) Program(objs *kube.Objects) error {
	state := objs.State(nil)
	var errs []error
	for _, n := range d.tb.Nodes {
		dp := d.nodes[n.Name]
		want := desiredFrontends(state, n.Name, topology.DefaultOptions(), agent.ProgrammedFamilies(dp.IPv6))
		for fe, svc := range want {
			if _, err := dp.SetService(fe, svc); err != nil {
				errs = append(errs, fmt.Errorf("node %s: %w", n.Name, err))
			}
		}
		for fe := range dp.Services() {
			if _, ok := want[fe]; !ok {
				if _, err := dp.DeleteFrontend(fe); err != nil {
					errs = append(errs, fmt.Errorf("node %s: %w", n.Name, err))
				}
			}
		}
	}
	return errors.Join(errs...)
}

// desiredFrontends is what the agent on node would program for state in
// the families it programs per scope (the agent's DebugState.ProgrammedFamilies),
// through the same functions.
func desiredFrontends(state *topology.State, node string, opts topology.Options, families agent.ScopeFamilies) map[maps.Frontend]maps.Service {
	ds, _ := state.DecideNode(node, opts)
	n, _ := state.Node(node)
	fes, _ := topology.NodeFrontends(n, ds, opts)
	want := map[maps.Frontend]maps.Service{}
	for _, f := range fes {
		if fe, ok := agent.DatapathFrontend(f.Key()); ok && families.Programs(f.Port.Family, f.Scope) {
			want[fe] = agent.DatapathService(f, n)
		}
	}
	return want
}

// Close unpins and closes every node's datapath: the programs are
// detached and the maps freed.
func (d *Direct) Close() error {
	d.tb.mu.Lock()
	if d.tb.direct == d {
		d.tb.direct = nil
	}
	d.tb.mu.Unlock()
	return d.unload()
}

func (d *Direct) unload() error {
	var errs []error
	for name, dp := range d.nodes {
		if err := dp.Unpin(); err != nil {
			errs = append(errs, fmt.Errorf("node %s: %w", name, err))
		}
		dp.Close()
	}
	d.nodes = nil
	return errors.Join(errs...)
}
