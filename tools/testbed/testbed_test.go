package testbed

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/internal/nettest"
)

// twoZones are tinySpec's zones: n1 (client c, backend b1) in z1, n2
// (backend b2) in z2.
const twoZones = `
zones:
- name: z1
  nodes:
  - name: n1
    pods: [{name: c, role: client}, {name: b1}]
- name: z2
  nodes:
  - name: n2
    pods: [{name: b2}]
`

const tinySpec = `
name: tiny` + twoZones + `services:
- name: s
  ports: [{name: http, port: 80}, {name: dns, protocol: UDP, port: 53}]
  endpoints: [{pod: b1}, {pod: b2}]
`

// requireRoot skips tests that cannot create namespaces or load BPF.
var requireRoot = nettest.RequireRoot

func tiny(t *testing.T) *Spec {
	t.Helper()
	s, err := ParseSpec([]byte(tinySpec))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// ours lists the namespaces of a testbed ID and whether its state
// directory and bpffs mount exist.
func ours(t *testing.T, id string) (nss []string, dir, mounted bool) {
	t.Helper()
	entries, _ := os.ReadDir(NetnsDir)
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), Prefix+id+"-") {
			nss = append(nss, e.Name())
		}
	}
	_, err := os.Stat(filepath.Join(DefaultStateRoot, id))
	dir = err == nil
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	mounted = strings.Contains(string(mi), filepath.Join(DefaultStateRoot, id)+"/")
	return nss, dir, mounted
}

// TestUpTrafficDown brings a two-node testbed up, checks the wiring
// (direct pod-to-pod traffic across the wire, offloads as documented),
// runs traffic through the in-process datapath, and checks Close leaves
// nothing behind.
func TestUpTrafficDown(t *testing.T) {
	requireRoot(t)
	ctx := t.Context()
	tb, err := New(ctx, tiny(t), Options{})
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			tb.Close()
		}
	})
	if nss, dir, mounted := ours(t, tb.ID); len(nss) != 6 || !dir || !mounted {
		t.Fatalf("after New: namespaces %v, state dir %v, bpffs mounted %v", nss, dir, mounted)
	}

	for _, c := range []struct {
		ns     *NS
		ifname string
		on     bool
	}{
		{tb.Pod("c").NS, PodIfName, true},
		{tb.Node("n1").NS, tb.Pod("c").HostVeth, false},
		{tb.Node("n1").NS, UplinkName, false},
		{tb.Fabric, "n1", false},
	} {
		on, err := c.ns.TxChecksum(c.ifname)
		if err != nil || on != c.on {
			t.Errorf("%s %s: tx checksum offload %v (%v), want %v", c.ns.Name, c.ifname, on, err, c.on)
		}
	}

	// Pod to pod across the wire, without any datapath.
	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	b2 := tb.Pod("b2")
	a, err := tb.Pod("c").Request(rctx, v1.ProtocolTCP, netipAddrPort(b2.Addr.String(), DefaultHTTPPort))
	if err != nil || a.Pod != "b2" || a.Node != "n2" || a.Zone != "z2" || !strings.HasPrefix(a.Client, tb.Pod("c").Addr.String()+":") {
		t.Fatalf("direct request to b2: %+v, %v", a, err)
	}

	if _, err := tb.AttachDirect(); err != nil {
		t.Fatal(err)
	}
	landings, err := tb.Measure(ctx, tb.Pod("c"), "s", MeasureOptions{Requests: 100})
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range landings {
		if p := l.Problems(); len(p) > 0 {
			t.Errorf("%s: %v", l.Decision.Protocol, p)
		}
	}
	if errs, err := tb.ChecksumErrors(); err != nil || len(errs) > 0 {
		t.Errorf("checksum errors %v, %v", errs, err)
	}

	id := tb.ID
	closed = true
	if err := tb.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if nss, dir, mounted := ours(t, id); len(nss) != 0 || dir || mounted {
		t.Errorf("after Close: namespaces %v, state dir %v, bpffs mounted %v", nss, dir, mounted)
	}
}

// TestCrashedRunIsCleaned kills a process that holds a testbed (with a
// pinned datapath) with SIGKILL, so nothing of its teardown runs, and
// checks that RemoveStale removes its namespaces, pins, bpffs mount and
// state directory.
func TestCrashedRunIsCleaned(t *testing.T) {
	requireRoot(t)
	if os.Getenv("TESTBED_CRASH_CHILD") != "" {
		t.Skip("runs only as the parent")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashChild$", "-test.v")
	cmd.Env = append(os.Environ(), "TESTBED_CRASH_CHILD=1")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	var id string
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "TESTBED-ID "); ok {
			id = rest
			break
		}
	}
	if id == "" {
		t.Fatal("child did not report a testbed")
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	if nss, dir, mounted := ours(t, id); len(nss) == 0 || !dir || !mounted {
		t.Fatalf("the killed child left nothing to clean (namespaces %v, dir %v, mount %v): the test tests nothing", nss, dir, mounted)
	}
	// RemoveStale also tries leftovers of other runs; one it cannot remove
	// (say, hidden under a later mount of /run/netns) is reported but is not
	// what this test is about. Ours must be gone, and then no error may name
	// our ID.
	staleErr := RemoveStale("")
	if nss, dir, mounted := ours(t, id); len(nss) != 0 || dir || mounted {
		t.Errorf("after RemoveStale: namespaces %v, state dir %v, bpffs mounted %v (RemoveStale: %v)", nss, dir, mounted, staleErr)
	}
	if staleErr != nil {
		if strings.Contains(staleErr.Error(), id) {
			t.Errorf("RemoveStale failed on this run's leftovers: %v", staleErr)
		} else {
			t.Logf("RemoveStale could not remove other runs' leftovers: %v", staleErr)
		}
	}
}

// TestCrashChild is the child of TestCrashedRunIsCleaned: it creates a
// testbed, pins a datapath, reports the ID and waits to be killed.
func TestCrashChild(t *testing.T) {
	if os.Getenv("TESTBED_CRASH_CHILD") == "" {
		t.Skip("helper process of TestCrashedRunIsCleaned")
	}
	tb, err := New(t.Context(), tiny(t), Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tb.AttachDirect(); err != nil {
		t.Fatal(err)
	}
	fmt.Printf("TESTBED-ID %s\n", tb.ID)
	time.Sleep(time.Minute)
	tb.Close()
}

func netipAddrPort(ip string, port uint16) netip.AddrPort {
	return netip.AddrPortFrom(netip.MustParseAddr(ip), port)
}

// TestFloodUDP injects frames with the live-frame flood through the
// in-process datapath and checks they reach the backend, where nothing
// listens on the port.
func TestFloodUDP(t *testing.T) {
	requireRoot(t)
	tb, err := New(t.Context(), tiny(t), Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer tb.Close()
	sink := ServiceSpec{Name: "sink", ClusterIP: "10.96.9.9", Ports: []PortSpec{{Protocol: v1.ProtocolUDP, Port: 9, TargetPort: 9}}, Endpoints: []EndpointSpec{{Pod: "b2"}}}
	if _, err := tb.Apply(t.Context(), []ServiceSpec{sink}); err != nil {
		t.Fatal(err)
	}
	if _, err := tb.AttachDirect(); err != nil {
		t.Fatal(err)
	}
	floodArrives(t, tb.Pod("b2").NS, 20000, func(n int) (FloodResult, error) {
		return tb.Pod("c").FloodUDP(netip.MustParseAddrPort("10.96.9.9:9"), n)
	})
	if errs, err := tb.ChecksumErrors(); err != nil || len(errs) > 0 {
		t.Errorf("checksum errors %v, %v", errs, err)
	}
}

// floodArrives floods n datagrams with flood and checks that at least
// 90% and at most all reached sink, where nothing listens on their port
// (CountArrivals). One datagram is sent first, until it arrives, so that
// every neighbour on the path is resolved: the live-frame flood injects
// all its frames in one system call, and frames to a neighbour still
// being resolved wait in its queue (neigh unres_qlen_bytes), which drops
// the rest (4,306 of 20,000 once under make test's load; arp_cache's
// unresolved_discards counted them).
func floodArrives(t *testing.T, sink *NS, n int, flood func(n int) (FloodResult, error)) {
	t.Helper()
	warm := func() (FloodResult, error) { return flood(1) }
	for deadline := time.Now().Add(5 * time.Second); ; {
		res, err := CountArrivals(sink, warm)
		if err != nil {
			t.Fatal(err)
		}
		if res.Arrived > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a single datagram did not reach %s in 5 s", sink.Name)
		}
	}
	before, err := kernelDrops()
	if err != nil {
		t.Fatal(err)
	}
	res, err := CountArrivals(sink, func() (FloodResult, error) { return flood(n) })
	if err != nil {
		t.Fatal(err)
	}
	after, err := kernelDrops()
	if err != nil {
		t.Fatal(err)
	}
	// A veth without NAPI hands each frame to the receiving CPU's backlog
	// queue (net.core.netdev_max_backlog), which drops what it cannot
	// hold when the CPUs are busy with other work (make test runs
	// packages side by side: 4,721 of 20,000 once). Those losses are the
	// kernel's, counted in softnet_stat, not the datapath's: they count as
	// delivered here, as do frames a neighbour queue dropped (after the
	// warm-up, only a neighbour that expired meanwhile). Drops by the
	// datapath are in neither.
	if after.backlog < before.backlog || after.neigh < before.neigh {
		t.Fatalf("the kernel's drop counters went back from %+v to %+v (a counter wrapped): run again", before, after)
	}
	queued, neigh := after.backlog-before.backlog, after.neigh-before.neigh
	t.Logf("%d frames in %v: %.0f pps; %d reached %s; %d dropped by backlog queues, %d by neighbour queues", res.Sent, res.Took, res.PPS, res.Arrived, sink.Name, queued, neigh)
	// Sent is the injecting program's own count: a test run interrupted by
	// a signal runs again, so it may exceed n, never fall short of it.
	if res.Sent < n {
		t.Errorf("the flood injected %d frames, asked for %d", res.Sent, n)
	}
	if sent := uint64(res.Sent); res.Arrived+queued+neigh < sent*9/10 || res.Arrived > sent {
		t.Errorf("%d of %d datagrams reached %s (%d more dropped by backlog queues, %d by neighbour queues), want at least 90%% and at most all", res.Arrived, res.Sent, sink.Name, queued, neigh)
	}
}

const outsideSpec = `
name: outside
kubeProxy: none
zones:
- name: z1
  nodes:
  - name: n1
    netfilter: {invalidDrop: true, tcpBeLiberal: false}
    pods: [{name: b1}]
  - name: n2
    wireMTU: 1400
    pods: [{name: b2}]
outside: {ingressNode: n2, clients: [{name: ext1}]}
services:
- {name: lb, type: LoadBalancer, loadBalancerIPs: [198.51.100.8], ports: [{port: 80}], endpoints: [{pod: b1}]}
`

// TestOutsideNetwork checks the wiring of the outside network and the node
// options: an outside client reaches node addresses through the router
// with its own source address, the router routes load-balancer IPs to the
// ingress node and forgets them with the Service, the live-frame flood
// from outside arrives, offloads and MTUs are as documented, the INVALID
// drop rule and the conntrack sysctl are in place, and kube-proxy is kept
// out.
func TestOutsideNetwork(t *testing.T) {
	requireRoot(t)
	ctx := t.Context()
	tb, _ := upTestbed(t, ctx, outsideSpec)
	ext, n1, n2, r := tb.External("ext1"), tb.Node("n1"), tb.Node("n2"), tb.Router

	for _, c := range []struct {
		ns     *NS
		ifname string
		on     bool
	}{
		{ext.NS, ExternalIfName, true},
		{r.NS, ext.RouterIf, false},
		{r.NS, UplinkName, false},
		{tb.Fabric, RouterPort, false},
	} {
		if on, err := c.ns.TxChecksum(c.ifname); err != nil || on != c.on {
			t.Errorf("%s %s: tx checksum offload %v (%v), want %v", c.ns.Name, c.ifname, on, err, c.on)
		}
	}
	for _, c := range []struct {
		ns     *NS
		ifname string
		mtu    int
	}{{n2.NS, UplinkName, 1400}, {tb.Fabric, "n2", 1400}, {n1.NS, UplinkName, 1500}} {
		if mtu, err := c.ns.MTU(c.ifname); err != nil || mtu != c.mtu {
			t.Errorf("%s %s: MTU %d (%v), want %d", c.ns.Name, c.ifname, mtu, err, c.mtu)
		}
	}

	// The outside client reaches a node's address, and the node sees the
	// client's own address.
	reachNode(t, ext, n1, v1.IPv4Protocol)

	// Load-balancer IPs are routed to the ingress node, and only while a
	// Service has them.
	routeVia := func() string {
		rs, err := r.NS.Netlink().RouteGet(net.ParseIP("198.51.100.8"))
		if err != nil {
			return "no route: " + err.Error()
		}
		return rs[0].Gw.String()
	}
	if gw := routeVia(); gw != n2.WireAddr.Addr().String() {
		t.Errorf("router sends 198.51.100.8 via %s, want the ingress node %s", gw, n2.WireAddr.Addr())
	}
	if _, err := tb.Apply(ctx, nil); err != nil {
		t.Fatal(err)
	}
	if gw := routeVia(); gw == n2.WireAddr.Addr().String() {
		t.Errorf("router still sends 198.51.100.8 to %s after the Service is gone", gw)
	}

	// A flood from outside crosses the router and the wire.
	floodArrives(t, n1.NS, 5000, func(n int) (FloodResult, error) {
		return ext.FloodUDP(netip.AddrPortFrom(n1.WireAddr.Addr(), 9), n)
	})

	save, err := outputIn(ctx, n1.NS, "iptables-save", "-t", "filter")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(save), "-A FORWARD -m conntrack --ctstate INVALID -m comment --comment \""+InvalidDropComment+"\" -j DROP") {
		t.Errorf("n1 has no INVALID drop rule:\n%s", save)
	}
	if v, err := n1.NS.ReadSysctl("net.netfilter.nf_conntrack_tcp_be_liberal"); err != nil || v != "0" {
		t.Errorf("n1 nf_conntrack_tcp_be_liberal = %q, %v", v, err)
	}

	if _, err := tb.StartKubeProxy(ctx, "n1", KubeProxyOptions{Binary: "/bin/true"}); err == nil || !strings.Contains(err.Error(), "kubeProxy: none") {
		t.Errorf("StartKubeProxy with kubeProxy none: %v", err)
	}
	if err := tb.CheckNoKubeProxy(ctx); err != nil {
		t.Errorf("fresh testbed: %v", err)
	}
	if err := runIn(n2.NS, "nft", "add", "table", "ip", "kube-proxy"); err != nil {
		t.Fatal(err)
	}
	if err := tb.CheckNoKubeProxy(ctx); err == nil || !strings.Contains(err.Error(), "node n2") {
		t.Errorf("a kube-proxy table on n2 went unnoticed: %v", err)
	}
}

// TestProcessInPod starts a process in a pod's namespace, pauses and
// resumes it (the kernel's process state says so), and checks Close stops
// it.
func TestProcessInPod(t *testing.T) {
	requireRoot(t)
	tb, err := New(t.Context(), tiny(t), Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer tb.Close()
	p, err := tb.StartProcess(t.Context(), tb.Pod("b1"), "sleeper", "sleep", "600")
	if err != nil {
		t.Fatal(err)
	}
	state := func() byte {
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.PID()))
		if err != nil {
			return 0
		}
		i := strings.LastIndexByte(string(stat), ')')
		return stat[i+2]
	}
	// Its namespace is the pod's, once nsenter has entered it and
	// exec'd the program.
	var podNS unix.Stat_t
	if err := unix.Stat(tb.Pod("b1").NS.Path, &podNS); err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("net:[%d]", podNS.Ino)
	var link string
	for deadline := time.Now().Add(2 * time.Second); link != want && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if link, err = os.Readlink(fmt.Sprintf("/proc/%d/ns/net", p.PID())); err != nil {
			t.Fatal(err)
		}
	}
	if link != want {
		t.Errorf("process in %s, want the pod's %s", link, want)
	}
	if err := p.Pause(); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(2 * time.Second); state() != 'T' && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	if s := state(); s != 'T' {
		t.Errorf("after Pause: state %q, want T (stopped)", s)
	}
	if err := p.Resume(); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(2 * time.Second); state() == 'T' && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	if s := state(); s == 'T' || s == 0 {
		t.Errorf("after Resume: state %q", s)
	}
	if err := p.Pause(); err != nil {
		t.Fatal(err)
	}
	// A paused process still stops on Close.
	if err := tb.Close(); err != nil {
		t.Fatal(err)
	}
	if p.Running() {
		t.Error("process still running after Close")
	}
}

// kernelDrops are the kernel's own counts of frames it dropped for want
// of queue room, summed over the CPUs since boot, the same for every
// namespace: backlog queues (/proc/net/softnet_stat, second column) and
// neighbour queues of both families (unresolved_discards of
// /proc/net/stat/arp_cache and ndisc_cache; the neighbour tables' counters
// are the kernel's, not a namespace's).
type kernelDropCounts struct{ backlog, neigh uint64 }

func kernelDrops() (kernelDropCounts, error) {
	var c kernelDropCounts
	var err error
	if c.backlog, err = backlogDrops(); err != nil {
		return c, err
	}
	for _, table := range []string{"arp_cache", "ndisc_cache"} {
		n, err := statColumn("/proc/net/stat/"+table, "unresolved_discards")
		if err != nil {
			return c, err
		}
		c.neigh += n
	}
	return c, nil
}

// statColumn sums the column named name of a /proc/net/stat file: a
// header line of names, then a line of hexadecimal counters per CPU.
func statColumn(path, name string) (uint64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	col := slices.Index(strings.Fields(lines[0]), name)
	if col < 0 {
		return 0, fmt.Errorf("%s has no column %s: %q", path, name, lines[0])
	}
	var sum uint64
	for _, line := range lines[1:] {
		f := strings.Fields(line)
		if len(f) <= col {
			return 0, fmt.Errorf("%s line %q: no column %d", path, line, col)
		}
		v, err := strconv.ParseUint(f[col], 16, 64)
		if err != nil {
			return 0, fmt.Errorf("%s line %q: %w", path, line, err)
		}
		sum += v
	}
	return sum, nil
}

// backlogDrops sums the frames every CPU's backlog queue dropped
// (/proc/net/softnet_stat, second column, hexadecimal), since boot.
func backlogDrops() (uint64, error) {
	b, err := os.ReadFile("/proc/net/softnet_stat")
	if err != nil {
		return 0, err
	}
	var sum uint64
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			return 0, fmt.Errorf("softnet_stat line %q: want at least 2 columns", line)
		}
		v, err := strconv.ParseUint(f[1], 16, 32)
		if err != nil {
			return 0, fmt.Errorf("softnet_stat line %q: %w", line, err)
		}
		sum += v
	}
	return sum, nil
}

// upTestbed brings up the testbed of the spec in specYAML, torn down
// (its errors failing the test) when the test ends.
func upTestbed(t *testing.T, ctx context.Context, specYAML string) (*Testbed, *Spec) {
	t.Helper()
	spec, err := ParseSpec([]byte(specYAML))
	if err != nil {
		t.Fatal(err)
	}
	tb, err := New(ctx, spec, Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := tb.Close(); err != nil {
			t.Errorf("teardown: %v", err)
		}
	})
	return tb, spec
}

// reachNode connects over TCP from the outside client ext to node's wire
// address of family, and fails unless the node sees ext's own address of
// that family.
func reachNode(t *testing.T, ext *External, node *Node, family v1.IPFamily) {
	t.Helper()
	target := netip.AddrPortFrom(pick(family, node.WireAddr, node.WireAddr6).Addr(), 7000)
	network := pick(family, "tcp4", "tcp6")
	l, err := node.NS.Listen(network, target.String())
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan string, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			accepted <- err.Error()
			return
		}
		accepted <- c.RemoteAddr().String()
		c.Close()
	}()
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
	defer cancel()
	c, err := ext.NS.DialContext(ctx, network, target.String())
	if err != nil {
		t.Fatalf("outside client to %s: %v", target, err)
	}
	c.Close()
	want := ext.ClientAddrOf(family)
	if from, err := netip.ParseAddrPort(<-accepted); err != nil || from.Addr() != want {
		t.Errorf("node %s saw the outside client as %v (%v), want %s", node.Name, from, err, want)
	}
}
