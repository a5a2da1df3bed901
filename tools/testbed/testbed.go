// Package testbed stands up the network of a small multi-zone Kubernetes
// cluster out of network namespaces on one Linux machine, from a
// declarative YAML spec, for topolb's demo and end-to-end tests.
//
// The network:
//
//	pod ns (eth0 10.244.N.K/32) ── vethK ┐
//	pod ns ─────────────────────── vethJ ┤ node ns ── eth0 (10.250.0.(1+N)/24)
//	                                     ┘                │ wire
//	                         fabric ns: br0 (10.250.0.1) ─┴─ n1, n2, ...
//
// Every node is a namespace acting as its host network. Its pods are
// namespaces with a veth to it, routed the way the CNI ptp plugin does it:
// the pod has a /32 and a default route via the node's gateway address,
// which sits on every host-side veth, and the node has a /32 route per pod.
// Nodes are plugged into a switch (a bridge in the fabric namespace) and
// route every other node's pod CIDR to that node's wire address; their
// default route points at the switch's address, so the wire is the device
// of the default route (`--uplinks auto`) and nothing is routed anywhere
// else. Pods keep their default offloads and send CHECKSUM_PARTIAL like
// real pods; every node-side and wire sender has transmit checksum offload
// off, so a wrong checksum written by the datapath is caught by the
// receiver (see ChecksumErrors).
//
// Optionally (Spec.Outside) a router namespace on the wire joins a network
// outside the cluster, whose clients (External) reach node addresses
// through it: NodePorts, and the external and load-balancer IPs the
// router sends to an ingress node. Nodes may get a smaller wire MTU and
// kube-proxy's INVALID-drop rule; kube-proxy runs only where a test starts
// it (Spec.KubeProxy "none": nowhere).
//
// Namespaces are named Prefix+"<pid>-<n>-<spec name>-..." and the state
// directory (manifest, private bpffs mount, agent logs) is
// StateRoot/<pid>-<n>; RemoveStale removes those of processes that are gone.
package testbed

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/topolb/topolb/internal/netns"
	"github.com/topolb/topolb/kube"
	"github.com/topolb/topolb/maps"
)

// Prefix starts the name of every namespace the testbed creates.
const Prefix = "tlbb-"

// DefaultStateRoot holds one directory per running testbed.
const DefaultStateRoot = "/run/topolb-testbed"

// Options tune New.
type Options struct {
	// StateRoot is where the testbed's directory is created. Default
	// DefaultStateRoot.
	StateRoot string
	// Logger receives progress at Info and details at Debug. Nil discards.
	Logger *slog.Logger
	// PlainSwitchPorts leaves the nodes' switch ports without an XDP
	// program (and without GRO), as a kind node's eth0 has its peer on
	// the host's bridge: frames a node's XDP program transmits back out
	// of its uplink are then dropped by the kernel, and the agents'
	// uplinks take the tc path (--uplink-path auto). By default every
	// node's port has one (napiForXDP) and the uplinks take XDP.
	PlainSwitchPorts bool
}

// Testbed is a running testbed. Close tears it down completely.
type Testbed struct {
	*Layout
	// traffic is the part that sends and measures traffic through the
	// testbed (measure.go, host.go, drain.go, wiresink.go, netns.go); its
	// methods are the Testbed's.
	traffic
	// ID is "<pid>-<n>", unique among running testbeds.
	ID string
	// Dir is the state directory: manifest.yaml, bpf/ (a private bpffs
	// mount, one subdirectory per node) and logs/.
	Dir string
	// Fabric is the switch's namespace.
	Fabric *NS

	log     *slog.Logger
	servers []*backendServers
	// plainPorts is Options.PlainSwitchPorts.
	plainPorts bool

	mu        sync.Mutex
	objs      *kube.Objects
	svcs      []ServiceSpec
	agents    []*Agent
	proxies   []*KubeProxy
	processes []*Process
	direct    *Direct
	kube      *kubeSync
	closed    bool
	bpfRoot   string
}

var seq atomic.Uint32

// New creates the testbed described by spec: namespaces, veths, addresses,
// routes and backend servers, and writes the manifest of spec.Services. On
// error everything created so far is removed. Leftovers of crashed runs are
// removed first.
func New(ctx context.Context, spec *Spec, opts Options) (_ *Testbed, err error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("the testbed needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_BPF)")
	}
	layout, err := NewLayout(spec)
	if err != nil {
		return nil, err
	}
	if opts.StateRoot == "" {
		opts.StateRoot = DefaultStateRoot
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if err := RemoveStale(opts.StateRoot); err != nil {
		log.Warn("removing leftovers of earlier runs", "err", err)
	}
	id := fmt.Sprintf("%d-%d", os.Getpid(), seq.Add(1))
	tb := &Testbed{Layout: layout, ID: id, Dir: filepath.Join(opts.StateRoot, id), log: log, plainPorts: opts.PlainSwitchPorts}
	tb.traffic.Testbed = tb
	defer func() {
		if err != nil {
			if cerr := tb.Close(); cerr != nil {
				log.Error("tearing down after a failed start", "err", cerr)
			}
		}
	}()
	if err := tb.mountBPFFS(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(tb.Dir, "logs"), 0o755); err != nil {
		return nil, err
	}
	if err := tb.build(ctx); err != nil {
		return nil, err
	}
	if _, err := tb.Apply(ctx, spec.Services); err != nil {
		return nil, err
	}
	log.Info("testbed up", "id", id, "nodes", len(tb.Nodes), "pods", len(tb.Pods), "dir", tb.Dir)
	return tb, nil
}

// nsName names a namespace of this testbed.
func (tb *Testbed) nsName(kind, name string) string {
	return fmt.Sprintf("%s%s-%s-%s%s", Prefix, tb.ID, tb.Spec.Name, kind, name)
}

// noDAD turns duplicate address detection off for every interface a
// namespace creates afterwards: without it an interface's IPv6 link-local
// address stays tentative for a second or more, and neighbour discovery
// through it waits. (The testbed's own addresses are added with nodad.)
var noDAD = [][2]string{
	{"net.ipv6.conf.all.accept_dad", "0"},
	{"net.ipv6.conf.default.accept_dad", "0"},
}

// newNS creates a namespace of this testbed (nsName), with noDAD in a
// dual-stack testbed. It returns the namespace even with an error, so
// the caller records it for Close.
func (tb *Testbed) newNS(kind, name string) (*NS, error) {
	ns, err := netns.Create(tb.nsName(kind, name))
	if err != nil || !tb.Spec.DualStack {
		return ns, err
	}
	for _, kv := range noDAD {
		if err := ns.Sysctl(kv[0], kv[1]); err != nil {
			return ns, err
		}
	}
	return ns, nil
}

// BPFFS returns the pin directory for a node's datapath, inside the
// testbed's private bpffs mount.
func (tb *Testbed) BPFFS(node string) string { return filepath.Join(tb.bpfRoot, node) }

// ForgetFlows deletes every node's conntrack entries and affinities
// (maps.FlushFlows), so the next request of any client is a new flow. A
// measurement of a new state needs it: a UDP request that reuses the source
// port of a request made before the change is the same flow, and keeps its
// backend while that backend still serves (draining) — as it would with
// kube-proxy. Nodes without a datapath are skipped.
func (tb *Testbed) ForgetFlows() error {
	var errs []error
	for _, n := range tb.Nodes {
		if _, err := os.Stat(filepath.Join(tb.BPFFS(n.Name), "tlb_conntrack")); err != nil {
			continue
		}
		if _, err := maps.FlushFlows(tb.BPFFS(n.Name)); err != nil {
			errs = append(errs, fmt.Errorf("node %s: %w", n.Name, err))
		}
	}
	return errors.Join(errs...)
}

// mountBPFFS creates the state directory and mounts a private bpf
// filesystem in it, so pins never land in /sys/fs/bpf and a crashed run's
// pins are removed with one unmount.
func (tb *Testbed) mountBPFFS() error {
	dir := filepath.Join(tb.Dir, "bpf")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create state dir: %w", err)
	}
	if err := unix.Mount("bpf", dir, "bpf", 0, "mode=0700"); err != nil {
		return fmt.Errorf("mount bpffs at %s: %w", dir, err)
	}
	tb.bpfRoot = dir
	return nil
}

func (tb *Testbed) build(ctx context.Context) error {
	fabric, err := tb.newNS("", "fabric")
	tb.Fabric = fabric
	if err != nil {
		return err
	}
	if err := fabric.AddBridge(BridgeName); err != nil {
		return err
	}
	if err := fabric.AddAddr(BridgeName, tb.FabricAddr.String()); err != nil {
		return err
	}
	if tb.FabricAddr6.IsValid() {
		if err := fabric.AddAddr(BridgeName, tb.FabricAddr6.String()); err != nil {
			return err
		}
	}

	for _, n := range tb.Nodes {
		if err := ctx.Err(); err != nil {
			return err
		}
		if n.NS, err = tb.newNS("n-", n.Name); err != nil {
			return err
		}
		// Before any interface exists, so every interface inherits it:
		// reverse-NATed replies carry a service address as source.
		if err := tb.makeRouter(n.NS); err != nil {
			return err
		}
		if err := tb.plugIntoWire(n.NS, n.SwitchPort(), n.WireMTU, !tb.plainPorts, n.WireAddr, n.WireAddr6); err != nil {
			return err
		}
		for _, gw := range []netip.Prefix{tb.FabricAddr, tb.FabricAddr6} {
			if gw.IsValid() {
				if err := n.NS.AddRouteDev("default", UplinkName, gw.Addr().String()); err != nil {
					return err
				}
			}
		}
		if err := tb.setNetfilter(n); err != nil {
			return err
		}
	}
	if err := tb.buildOutside(); err != nil {
		return err
	}
	for _, n := range tb.Nodes {
		for _, o := range tb.Nodes {
			if o != n {
				if err := n.NS.AddRouteDev(o.PodCIDR.String(), UplinkName, o.WireAddr.Addr().String()); err != nil {
					return err
				}
				if o.PodCIDR6.IsValid() {
					if err := n.NS.AddRouteDev(o.PodCIDR6.String(), UplinkName, o.WireAddr6.Addr().String()); err != nil {
						return err
					}
				}
			}
		}
		for _, p := range n.Pods {
			if err := tb.buildPod(p); err != nil {
				return err
			}
		}
	}
	return nil
}

// plugIntoWire connects ns to the switch: a veth with UplinkName in ns and
// port on the bridge, addrs (the valid ones: IPv4, and IPv6 in a
// dual-stack testbed) on it, and mtu (when not 0) on both ends. Like
// a real NIC, both ends put finished checksums on the wire (transmit
// checksum offload off), so receivers verify them. With napi (a node's
// port, unless Options.PlainSwitchPorts) the switch port gets a NAPI
// instance (napiForXDP), so the node's XDP program can send frames back
// out of its uplink (XDP_TX, XDP_REDIRECT); the router's port does
// without: a NAPI veth takes at most
// its ring (256 frames) between two polls, where a plain one queues to the
// CPU's backlog.
func (tb *Testbed) plugIntoWire(ns *NS, port string, mtu int, napi bool, addrs ...netip.Prefix) error {
	if err := netns.Veth(ns, UplinkName, tb.Fabric, port); err != nil {
		return err
	}
	if err := tb.Fabric.SetMaster(port, BridgeName); err != nil {
		return err
	}
	if mtu != 0 {
		if err := ns.SetMTU(UplinkName, mtu); err != nil {
			return err
		}
		if err := tb.Fabric.SetMTU(port, mtu); err != nil {
			return err
		}
	}
	for _, addr := range addrs {
		if !addr.IsValid() {
			continue
		}
		if err := ns.AddAddr(UplinkName, addr.String()); err != nil {
			return err
		}
	}
	if err := ns.SetTxChecksum(UplinkName, false); err != nil {
		return err
	}
	if napi {
		if err := napiForXDP(tb.Fabric, port); err != nil {
			return err
		}
	}
	return tb.Fabric.SetTxChecksum(port, false)
}

// hostRoute is a gateway and an address of one family wired point to
// point (wirePointToPoint); an invalid pair is skipped.
type hostRoute struct{ gw, addr netip.Addr }

// wirePointToPoint connects guest (a pod, an outside client) to host (its
// node, the router) the way the CNI ptp plugin does: a veth and, for each
// family's pair, gw on the host side as a host route (/32 or /128, the
// same gw on every such veth of host), addr as one in the guest with a
// default route via gw, and a host route to addr on the host. The host
// side finishes checksums in software; the guest keeps its offloads and
// sends CHECKSUM_PARTIAL, as a real pod does.
func wirePointToPoint(host *NS, hostIf string, guest *NS, guestIf string, pairs ...hostRoute) error {
	if err := netns.Veth(host, hostIf, guest, guestIf); err != nil {
		return err
	}
	var steps []func() error
	for _, p := range pairs {
		if !p.addr.IsValid() {
			continue
		}
		gw, addr := netip.PrefixFrom(p.gw, p.gw.BitLen()).String(), netip.PrefixFrom(p.addr, p.addr.BitLen()).String()
		steps = append(steps,
			func() error { return host.AddAddr(hostIf, gw) },
			func() error { return host.AddRouteDev(addr, hostIf, "") },
			func() error { return guest.AddAddr(guestIf, addr) },
			func() error { return guest.AddRouteDev(gw, guestIf, "") },
			func() error { return guest.AddRouteDev("default", guestIf, p.gw.String()) },
		)
	}
	steps = append(steps, func() error { return host.SetTxChecksum(hostIf, false) })
	for _, step := range steps {
		if err := step(); err != nil {
			return err
		}
	}
	return nil
}

func (tb *Testbed) buildPod(p *Pod) (err error) {
	n := p.Node
	if p.NS, err = tb.newNS("p-", p.Name); err != nil {
		return err
	}
	if err := wirePointToPoint(n.NS, p.HostVeth, p.NS, PodIfName, hostRoute{n.Gateway, p.Addr}, hostRoute{n.Gateway6, p.Addr6}); err != nil {
		return err
	}
	if err := n.NS.SetAlias(p.HostVeth, p.Name); err != nil {
		return err
	}
	if p.Role == RoleBackend {
		tcp, udp := tb.Spec.BackendPorts()
		s, err := serveBackend(p, tcp, udp)
		if err != nil {
			return err
		}
		tb.servers = append(tb.servers, s)
	}
	return nil
}

// namespaces returns every namespace of the testbed that exists: outside
// clients, router, pods, nodes, fabric.
func (tb *Testbed) namespaces() []*NS {
	var out []*NS
	for _, e := range tb.Externals {
		if e.NS != nil {
			out = append(out, e.NS)
		}
	}
	if tb.Router != nil && tb.Router.NS != nil {
		out = append(out, tb.Router.NS)
	}
	for _, p := range tb.Pods {
		if p.NS != nil {
			out = append(out, p.NS)
		}
	}
	for _, n := range tb.Nodes {
		if n.NS != nil {
			out = append(out, n.NS)
		}
	}
	if tb.Fabric != nil {
		out = append(out, tb.Fabric)
	}
	return out
}

// Close tears the testbed down: processes in pods, agents and kube-proxies
// (SIGKILL if SIGTERM does not stop them), the in-process datapath, backend servers, pins, the bpffs mount,
// every namespace and the state directory. It is safe to call more than
// once and keeps going after errors, which it returns joined.
func (tb *Testbed) Close() error {
	tb.mu.Lock()
	if tb.closed {
		tb.mu.Unlock()
		return nil
	}
	tb.closed = true
	agents, proxies, processes, direct, ks := tb.agents, tb.proxies, tb.processes, tb.direct, tb.kube
	tb.mu.Unlock()

	var errs []error
	for _, p := range processes {
		if err := p.Stop(); err != nil {
			errs = append(errs, err)
		}
	}
	for _, a := range agents {
		if err := a.Stop(); err != nil {
			errs = append(errs, err)
		}
	}
	for _, k := range proxies {
		if err := k.Stop(); err != nil {
			errs = append(errs, err)
		}
	}
	if direct != nil {
		errs = append(errs, direct.Close())
	}
	if ks != nil {
		ks.close()
	}
	for _, s := range tb.servers {
		s.close()
	}
	if tb.bpfRoot != "" {
		if err := removePins(tb.bpfRoot); err != nil {
			errs = append(errs, err)
		}
		if err := unix.Unmount(tb.bpfRoot, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
			errs = append(errs, fmt.Errorf("unmount bpffs: %w", err))
		}
	}
	for _, ns := range tb.namespaces() {
		if err := ns.Delete(); err != nil {
			errs = append(errs, err)
		}
	}
	if tb.Dir != "" {
		if err := os.RemoveAll(tb.Dir); err != nil {
			errs = append(errs, fmt.Errorf("remove state dir: %w", err))
		}
	}
	tb.log.Info("testbed down", "id", tb.ID)
	return errors.Join(errs...)
}

// removePins removes every pin under a bpffs mount (the kernel's own
// *.debug iterator files at its root stay until the unmount).
func removePins(root string) error {
	entries, err := os.ReadDir(root)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("remove pins: %w", err)
	}
	var errs []error
	for _, e := range entries {
		if !e.IsDir() && strings.HasSuffix(e.Name(), ".debug") {
			continue
		}
		if err := os.RemoveAll(filepath.Join(root, e.Name())); err != nil {
			errs = append(errs, fmt.Errorf("remove pins: %w", err))
		}
	}
	return errors.Join(errs...)
}

// RemoveStale removes what testbeds of processes that no longer exist left
// behind: their agents (still running only if they lost their parent's
// death signal), pins and bpffs mounts, state directories and namespaces.
// Testbeds of running processes are left alone.
func RemoveStale(stateRoot string) error {
	if stateRoot == "" {
		stateRoot = DefaultStateRoot
	}
	var errs []error
	entries, err := os.ReadDir(stateRoot)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	for _, e := range entries {
		pid, ok := netns.OwnerPID(e.Name())
		if !ok || netns.ProcessAlive(pid) {
			continue
		}
		dir := filepath.Join(stateRoot, e.Name())
		killStrayProcesses(dir)
		bpf := filepath.Join(dir, "bpf")
		removePins(bpf) // best effort: the unmount drops the rest
		if err := unix.Unmount(bpf, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("unmount stale bpffs %s: %w", bpf, err))
		}
		if err := os.RemoveAll(dir); err != nil {
			errs = append(errs, fmt.Errorf("remove stale state %s: %w", dir, err))
		}
	}
	if err := netns.RemoveStale(Prefix); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// traffic is the Testbed's part that sends and measures traffic: it holds
// the Testbed it belongs to.
type traffic struct{ *Testbed }
