package deploy

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
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

	v1 "k8s.io/api/core/v1"

	"github.com/topolb/topolb/agent"
	"github.com/topolb/topolb/internal/nettest"
	"github.com/topolb/topolb/maps"
)

// capsManifest is a one-service cluster: from node-a, whose zone is zone-a,
// the service's only permitted backend is the zone-a one.
const capsManifest = `apiVersion: v1
kind: Node
metadata: {name: node-a, labels: {topology.kubernetes.io/zone: zone-a}}
---
apiVersion: v1
kind: Node
metadata: {name: node-b, labels: {topology.kubernetes.io/zone: zone-b}}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: [10.244.1.5], nodeName: node-a, zone: zone-a, hints: {forZones: [{name: zone-a}]}}
- {addresses: [10.244.2.5], nodeName: node-b, zone: zone-b, hints: {forZones: [{name: zone-b}]}}
`

var (
	capsFrontend = maps.Frontend{Addr: netip.MustParseAddrPort("10.96.0.10:80"), Proto: maps.TCP}
	capsBackend  = netip.MustParseAddrPort("10.244.1.5:8080")
)

// Small maps load quickly; the capabilities needed do not depend on sizes.
const (
	capsMaxFrontends = 1024
	capsMaxBackends  = 4096
	capsMaxConntrack = 4096
)

// TestCapabilities runs topolb-agent as a container with `drop: [ALL]` and
// `add: [...]` from deploy/daemonset.yaml runs it: uid 0 with only the listed
// capabilities in its bounding, permitted and effective sets, and no new
// privileges. In a node namespace of its own (a pod veth for tc, a default
// route device for XDP, a private bpffs) and with the pod's mounts (only the
// node's pin directory, at the DaemonSet's mountPath in a fresh sysfs, as a
// container runtime mounts one) it must load, attach both hooks, pin, write
// the service into the maps and report ready. Then, for each
// listed capability, the agent runs without it and must fail with an error
// that names the step and the denied permission: a capability the agent
// does not need belongs out of the manifest.
func TestCapabilities(t *testing.T) {
	nettest.RequireRoot(t)
	requireDatapathKernel(t)
	for _, tool := range []string{"capsh", "nsenter", "bpftool"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s (make deps installs it): %v", tool, err)
		}
	}
	for _, tool := range []string{"unshare", "mount"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s (util-linux): %v", tool, err)
		}
	}
	_, c := agentDaemonSet(t)
	listed := manifestCapabilities(t, c)
	mountPath := podPinMount(t)
	cgroupPath := podCgroupMount(t)
	if _, err := maps.CgroupRoot(nodeCgroupDir); err != nil {
		t.Skipf("this machine has no cgroup v2 root under %s for the socket hooks: %v", nodeCgroupDir, err)
	}
	all := knownCapabilities(t)
	own := decodeCapabilities(t, procStatusField(t, "self", "CapBnd"))
	for _, name := range listed {
		if !slices.Contains(all, name) {
			t.Fatalf("deploy/daemonset.yaml adds %s, which this kernel does not know", name)
		}
		if !slices.Contains(own, name) {
			t.Skipf("this process lacks %s in its bounding set: cannot grant it to the agent", name)
		}
	}
	agent := agentBinary(t)
	manifest := filepath.Join(t.TempDir(), "cluster.yaml")
	if err := os.WriteFile(manifest, []byte(capsManifest), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("capabilities from deploy/daemonset.yaml: %s", strings.Join(listed, ","))

	t.Run("listed", func(t *testing.T) {
		n := newCapsNode(t)
		p := startInPod(t, n, mountPath, cgroupPath, agent, listed, nil, capsAgentArgs(mountPath, cgroupPath, manifest))
		if err := p.waitReady(t, 60*time.Second); err != nil {
			t.Fatalf("agent with %s: %v\nstderr:\n%s", strings.Join(listed, ","), err, p.stderr.String())
		}
		// The agent holds exactly the listed capabilities, as in the pod.
		eff := decodeCapabilities(t, procStatusField(t, strconv.Itoa(p.cmd.Process.Pid), "CapEff"))
		if !slices.Equal(eff, listed) {
			t.Errorf("agent's effective capabilities = %v, want %v", eff, listed)
		}
		for _, pin := range []string{"tlb_services", "tlb_backends", "tlb_conntrack", "links/tc_pod0", "links/tcegress_pod0", "links/xdp_uplink0", "links/uplink_uplink0",
			"links/sock_connect4", "links/sock_sendmsg4", "links/sock_recvmsg4", "links/sock_getpeername4",
			"links/sock_connect6", "links/sock_sendmsg6", "links/sock_recvmsg6", "links/sock_getpeername6"} {
			if _, err := os.Stat(filepath.Join(n.pinPath, pin)); err != nil {
				t.Errorf("pin %s: %v", pin, err)
			}
		}
		checkUplinkReadBack(t, p)
		if err := p.stop(10 * time.Second); err != nil {
			t.Errorf("agent did not stop cleanly: %v\nstderr:\n%s", err, p.stderr.String())
		}
		checkServicesMap(t, n.pinPath)
	})

	for _, drop := range listed {
		t.Run("without_"+drop, func(t *testing.T) {
			n := newCapsNode(t)
			keep := slices.DeleteFunc(slices.Clone(listed), func(c string) bool { return c == drop })
			p := startInPod(t, n, mountPath, cgroupPath, agent, keep, nil, capsAgentArgs(mountPath, cgroupPath, manifest))
			code, err := p.waitExit(t, 60*time.Second)
			if err != nil {
				t.Fatalf("agent without %s: %v: if it works without it, remove %s from deploy/daemonset.yaml\nstderr:\n%s",
					drop, err, strings.TrimPrefix(strings.ToUpper(drop), "CAP_"), p.stderr.String())
			}
			msg := lastLine(p.stderr.String())
			t.Logf("without %s: exit %d: %s", drop, code, msg)
			if code == 0 {
				t.Errorf("agent without %s exited 0", drop)
			}
			if !strings.HasPrefix(msg, "Error: ") ||
				!(strings.Contains(msg, "load datapath") || strings.Contains(msg, "attach")) ||
				!(strings.Contains(msg, "operation not permitted") || strings.Contains(msg, "permission denied")) {
				t.Errorf("agent without %s: want an error naming the failed step (load datapath, attach) and the denied permission, got %q", drop, msg)
			}
		})
	}
}

// manifestCapabilities returns the agent container's added capabilities as
// capsh names (cap_bpf), sorted in kernel order, after checking that it
// drops all others and is not privileged.
func manifestCapabilities(t testing.TB, c *v1.Container) []string {
	t.Helper()
	sc := c.SecurityContext
	if sc == nil || sc.Capabilities == nil {
		t.Fatal("deploy/daemonset.yaml: agent has no securityContext.capabilities")
	}
	if sc.Privileged != nil && *sc.Privileged {
		t.Fatal("deploy/daemonset.yaml: agent is privileged; it must list capabilities instead")
	}
	if !slices.Equal(sc.Capabilities.Drop, []v1.Capability{"ALL"}) {
		t.Fatalf("deploy/daemonset.yaml: capabilities.drop = %v, want [ALL]", sc.Capabilities.Drop)
	}
	if sc.RunAsUser == nil || *sc.RunAsUser != 0 {
		t.Fatal("deploy/daemonset.yaml: agent must run as uid 0 (runAsUser: 0), as this test does")
	}
	if len(sc.Capabilities.Add) == 0 {
		t.Fatal("deploy/daemonset.yaml: capabilities.add is empty")
	}
	all := knownCapabilities(t)
	var out []string
	for _, c := range sc.Capabilities.Add {
		name := "cap_" + strings.ToLower(strings.TrimPrefix(string(c), "CAP_"))
		if slices.Contains(out, name) {
			t.Fatalf("deploy/daemonset.yaml: %s added twice", c)
		}
		out = append(out, name)
	}
	slices.SortFunc(out, func(a, b string) int { return slices.Index(all, a) - slices.Index(all, b) })
	return out
}

// knownCapabilities lists the kernel's capabilities by capsh name, in
// kernel order.
func knownCapabilities(t testing.TB) []string {
	t.Helper()
	b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err != nil {
		t.Fatal(err)
	}
	last, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || last < 0 || last > 63 {
		t.Fatalf("cap_last_cap %q: %v", b, err)
	}
	return decodeCapabilities(t, strconv.FormatUint(1<<(last+1)-1, 16))
}

// decodeCapabilities turns a hex capability mask into capsh names, in
// kernel order.
func decodeCapabilities(t testing.TB, hexMask string) []string {
	t.Helper()
	out, err := exec.Command("capsh", "--decode="+strings.TrimPrefix(hexMask, "0x")).Output()
	if err != nil {
		t.Fatalf("capsh --decode=%s: %v", hexMask, err)
	}
	_, names, ok := strings.Cut(strings.TrimSpace(string(out)), "=")
	if !ok {
		t.Fatalf("capsh --decode=%s: unexpected output %q", hexMask, out)
	}
	if names == "" {
		return nil
	}
	return strings.Split(names, ",")
}

// procStatusField reads a field such as CapEff from /proc/<pid>/status.
func procStatusField(t testing.TB, pid, field string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("/proc", pid, "status"))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	t.Fatalf("/proc/%s/status has no %s", pid, field)
	return ""
}

// capsNode is a node's network namespace with a pod veth (pod0, the tc
// target), a default route through a veth to a gateway namespace (uplink0,
// the XDP target) and a private bpffs. Only veths: the kernel may lack the
// dummy driver.
type capsNode struct {
	ns      *nettest.NS
	pinPath string
}

func newCapsNode(t *testing.T) *capsNode {
	t.Helper()
	ns := nettest.NewNS(t, "caps-node")
	pod := nettest.NewNS(t, "caps-pod")
	if err := nettest.Veth(ns, "pod0", pod, "eth0"); err != nil {
		t.Fatal(err)
	}
	gw := nettest.NewNS(t, "caps-gw")
	if err := nettest.Veth(ns, "uplink0", gw, "eth0"); err != nil {
		t.Fatal(err)
	}
	for _, step := range []error{ns.AddAddr("uplink0", "192.0.2.1/24"), ns.AddRoute("default", "192.0.2.2")} {
		if step != nil {
			t.Fatal(step)
		}
	}
	// Unmounting it in cleanup drops the pins: maps, and links (which
	// detaches).
	return &capsNode{ns: ns, pinPath: filepath.Join(nettest.BPFFS(t), "topolb")}
}

// capsAgentArgs runs the agent on node-a in standalone mode, pinning at
// pinPath and attaching the socket hooks under cgroupPath, with the default
// (automatic) uplinks and pod interfaces, as the DaemonSet does.
// checkUplinkReadBack checks that the agent, with only the listed
// capabilities, reads its uplink's path back from the kernel for
// /debug/state (and so for topolb_uplink_path).
func checkUplinkReadBack(t *testing.T, p *agentProc) {
	t.Helper()
	resp, err := p.ns.HTTPClient(5 * time.Second).Get("http://" + agent.DefaultHealthAddress + "/debug/state")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st struct {
		Uplinks []struct {
			Interface, Path string
			Programs        []string
		} `json:"uplinks"`
		UplinksError string `json:"uplinksError"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatalf("decode /debug/state: %v", err)
	}
	if st.UplinksError != "" || len(st.Uplinks) != 1 || st.Uplinks[0].Interface != "uplink0" || st.Uplinks[0].Path != "xdp" {
		t.Errorf("/debug/state uplinks %+v (error %q), want uplink0 on xdp", st.Uplinks, st.UplinksError)
	}
}

func capsAgentArgs(pinPath, cgroupPath, manifest string) []string {
	// XDP forced: uplink0's peer has no XDP program, so auto would take
	// the tc path, and the capabilities must be enough for XDP too.
	return []string{"--node-name=node-a", "--from-file=" + manifest, "--bpffs=" + pinPath, "--cgroup-root=" + cgroupPath, "--uplink-path=xdp",
		"--health-address=" + agent.DefaultHealthAddress, "--metrics-address=",
		"--max-frontends=" + strconv.Itoa(capsMaxFrontends), "--max-backends=" + strconv.Itoa(capsMaxBackends),
		"--max-conntrack=" + strconv.Itoa(capsMaxConntrack)}
}

type agentProc struct {
	cmd    *exec.Cmd
	ns     *nettest.NS
	stderr *syncBuffer
	done   chan struct{}
	err    error
}

// startRestricted starts the agent with agentArgs and env (besides PATH) in
// ns, as uid 0 with only the capabilities keep: capsh drops every other one
// from the bounding set (inheritable and ambient are empty), sets
// no_new_privs, and execs the agent, whose permitted and effective sets as
// root then equal the bounding set, as in a container.
func startRestricted(t *testing.T, ns *nettest.NS, agent string, keep, env, agentArgs []string) *agentProc {
	t.Helper()
	return startWrapped(t, ns, nil, agent, keep, env, agentArgs)
}

// podMounts sets up, in a mount namespace of the agent's own, the mounts
// deploy/daemonset.yaml gives the pod, as a container runtime does: the
// node's cgroup file system ($4, with its submounts) read-only at $3 under
// /run, which in the pod is the container's (a tmpfs stands in for it, so
// nothing is created on the machine's /run); a fresh sysfs at /sys, as the
// runtime mounts for the container; and the node's pin directory ($1,
// created as the kubelet's DirectoryOrCreate does) bind-mounted at $2,
// whose mount point must already exist in that sysfs (mkdir fails there,
// as it fails the runtime). Then it runs the rest of its arguments.
const podMounts = `set -e
mkdir -p "$1"
mount -t tmpfs -o size=1m,mode=0755 tmpfs /run
mkdir -p "$3"
mount --rbind "$4" "$3"
mount -o remount,bind,ro "$3"
mkdir /run/.pin
mount --bind "$1" /run/.pin
mount -t sysfs sysfs /sys
mkdir -p "$2"
mount --move /run/.pin "$2"
rmdir /run/.pin
shift 4
exec "$@"`

// startInPod is startRestricted with the pod's mounts (podMounts): the
// agent sees the node's pin directory n.pinPath at mountPath and the
// machine's cgroup file system at cgroupPath only.
func startInPod(t *testing.T, n *capsNode, mountPath, cgroupPath, agent string, keep, env, agentArgs []string) *agentProc {
	t.Helper()
	if mountPath != "/sys/fs/bpf" && !strings.HasPrefix(mountPath, "/sys/fs/bpf/") {
		t.Fatalf("deploy/daemonset.yaml mounts the pin directory at %s, outside /sys/fs/bpf: update podMounts", mountPath)
	}
	if !strings.HasPrefix(cgroupPath, "/run/") {
		t.Fatalf("deploy/daemonset.yaml mounts the cgroup file system at %s, outside /run: update podMounts", cgroupPath)
	}
	wrap := []string{"unshare", "--mount", "--propagation", "private", "sh", "-c", podMounts, "sh", n.pinPath, mountPath, cgroupPath, nodeCgroupDir}
	return startWrapped(t, n.ns, wrap, agent, keep, env, agentArgs)
}

// startWrapped is startRestricted with wrap (a command that runs the rest
// of its arguments) between nsenter and capsh.
func startWrapped(t *testing.T, ns *nettest.NS, wrap []string, agent string, keep, env, agentArgs []string) *agentProc {
	t.Helper()
	var drop []string
	for _, c := range knownCapabilities(t) {
		if !slices.Contains(keep, c) {
			drop = append(drop, c)
		}
	}
	args := append([]string{"--net=" + ns.Path}, wrap...)
	args = append(append(args, "capsh", "--drop="+strings.Join(drop, ","), "--no-new-privs",
		"--shell="+agent, "--"), agentArgs...)
	p := &agentProc{cmd: exec.Command("nsenter", args...), ns: ns, stderr: &syncBuffer{}, done: make(chan struct{})}
	p.cmd.Stdout = p.stderr
	p.cmd.Stderr = p.stderr
	p.cmd.Env = append([]string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin"}, env...)
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start agent: %v", err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

// waitReady waits for /readyz to answer 200, or fails if the agent exits.
func (p *agentProc) waitReady(t *testing.T, timeout time.Duration) error {
	client := p.ns.HTTPClient(time.Second)
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		select {
		case <-p.done:
			return fmt.Errorf("exited before ready: %v", p.err)
		default:
		}
		if resp, err := client.Get("http://" + agent.DefaultHealthAddress + "/readyz"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("not ready after %s", timeout)
}

// waitExit waits for the agent to exit and returns its exit code; it is an
// error if the agent becomes ready or keeps running instead.
func (p *agentProc) waitExit(t *testing.T, timeout time.Duration) (int, error) {
	client := p.ns.HTTPClient(time.Second)
	deadline := time.After(timeout)
	for {
		select {
		case <-p.done:
			var exit *exec.ExitError
			if errors.As(p.err, &exit) {
				return exit.ExitCode(), nil
			}
			if p.err != nil {
				return -1, p.err
			}
			return 0, nil
		case <-deadline:
			return -1, fmt.Errorf("still running after %s", timeout)
		case <-time.After(200 * time.Millisecond):
		}
		if resp, err := client.Get("http://" + agent.DefaultHealthAddress + "/readyz"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return -1, errors.New("became ready")
			}
		}
	}
}

// stop sends SIGTERM and expects a clean exit.
func (p *agentProc) stop(timeout time.Duration) error {
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		return err
	}
	select {
	case <-p.done:
		return p.err
	case <-time.After(timeout):
		return fmt.Errorf("no exit %s after SIGTERM", timeout)
	}
}

// checkServicesMap reads the pinned services map back twice: with bpftool,
// as the README tells operators to, and through maps (adopting the pins the
// agent left), whose Dump reads the kernel's maps. Then it unpins.
func checkServicesMap(t *testing.T, pinPath string) {
	t.Helper()
	out, err := exec.Command("bpftool", "-j", "map", "dump", "pinned", filepath.Join(pinPath, "tlb_services")).Output()
	if err != nil {
		t.Fatalf("bpftool map dump pinned tlb_services: %v", err)
	}
	var entries []json.RawMessage
	if err := json.Unmarshal(out, &entries); err != nil {
		t.Fatalf("bpftool output: %v\n%s", err, out)
	}
	if len(entries) != 1 {
		t.Errorf("bpftool: tlb_services holds %d entries, want 1 (10.96.0.10:80/TCP)\n%s", len(entries), out)
	}

	dp, err := maps.Load(maps.Options{PinPath: pinPath, MaxFrontends: capsMaxFrontends, MaxBackends: capsMaxBackends, MaxConntrack: capsMaxConntrack})
	if err != nil {
		t.Fatalf("adopt the agent's pins: %v", err)
	}
	defer dp.Close()
	defer func() {
		if err := dp.Unpin(); err != nil {
			t.Errorf("unpin: %v", err)
		}
	}()
	dump, err := dp.Dump()
	if err != nil {
		t.Fatalf("dump maps: %v", err)
	}
	var got []netip.AddrPort
	for _, b := range dump[capsFrontend] {
		got = append(got, b.Addr)
	}
	if len(dump) != 1 || !slices.Equal(got, []netip.AddrPort{capsBackend}) {
		t.Errorf("programmed frontends = %v, want only %s -> [%s]", dump, capsFrontend, capsBackend)
	}
}
