package deploy

import (
	"net"
	"regexp"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
)

// nodePinDir is the directory on the node's bpf filesystem that holds
// topolb's pins; the DaemonSet must mount it, and nothing else of
// /sys/fs/bpf.
const nodePinDir = "/sys/fs/bpf/topolb"

// podPinDir is where the pod sees nodePinDir: a directory of the
// container's sysfs that exists. The runtime cannot create a mount point in
// sysfs (mkdir fails there), so /sys/fs/bpf/topolb in the pod would fail
// every container start.
const podPinDir = "/sys/fs/bpf"

// nodeCgroupDir is the node's cgroup file system, whose cgroup v2 root the
// socket hooks attach to; the DaemonSet mounts it read-only.
const nodeCgroupDir = "/sys/fs/cgroup"

// agentArg returns the value of --name=value in the agent's arguments.
func agentArg(t testing.TB, c *v1.Container, name string) string {
	t.Helper()
	var found []string
	for _, a := range c.Args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			found = append(found, v)
		}
	}
	if len(found) != 1 {
		t.Fatalf("deploy/daemonset.yaml: agent has %d --%s arguments, want 1", len(found), name)
	}
	return found[0]
}

// hostMount returns the path at which the agent container mounts the
// DaemonSet's hostPath volume of the node's path, and the mount, after
// checking that the volume has the type want and is mounted once, without
// mount propagation.
func hostMount(t testing.TB, path string, want v1.HostPathType) v1.VolumeMount {
	t.Helper()
	ds, c := agentDaemonSet(t)
	var vol *v1.Volume
	for i, v := range ds.Spec.Template.Spec.Volumes {
		if v.HostPath != nil && v.HostPath.Path == path {
			vol = &ds.Spec.Template.Spec.Volumes[i]
		}
	}
	if vol == nil {
		t.Fatalf("deploy/daemonset.yaml: no hostPath volume of the node's %s", path)
	}
	if vol.HostPath.Type == nil || *vol.HostPath.Type != want {
		t.Errorf("deploy/daemonset.yaml: hostPath %s type %v, want %s", path, vol.HostPath.Type, want)
	}
	var mount *v1.VolumeMount
	for i, m := range c.VolumeMounts {
		if m.Name == vol.Name {
			if mount != nil {
				t.Fatalf("deploy/daemonset.yaml: volume %s mounted twice", vol.Name)
			}
			mount = &c.VolumeMounts[i]
			if m.MountPropagation != nil && *m.MountPropagation != v1.MountPropagationNone {
				t.Errorf("deploy/daemonset.yaml: %s mounted with %s propagation, want none", path, *m.MountPropagation)
			}
		}
	}
	if mount == nil {
		t.Fatalf("deploy/daemonset.yaml: volume %s is not mounted", vol.Name)
	}
	return *mount
}

// checkHostPaths checks that the DaemonSet's hostPath volumes are exactly
// the pin directory and the cgroup file system.
func checkHostPaths(t testing.TB) {
	t.Helper()
	ds, _ := agentDaemonSet(t)
	var paths []string
	for _, v := range ds.Spec.Template.Spec.Volumes {
		if v.HostPath != nil {
			paths = append(paths, v.HostPath.Path)
		}
	}
	slices.Sort(paths)
	if want := []string{nodePinDir, nodeCgroupDir}; !slices.Equal(paths, want) {
		t.Fatalf("deploy/daemonset.yaml: hostPath volumes %v, want exactly %v", paths, want)
	}
}

// podPinMount checks that the DaemonSet mounts the node's
// /sys/fs/bpf/topolb (created if missing) at the path the agent pins under
// (--bpffs), and returns that path.
func podPinMount(t testing.TB) string {
	t.Helper()
	checkHostPaths(t)
	_, c := agentDaemonSet(t)
	m := hostMount(t, nodePinDir, v1.HostPathDirectoryOrCreate)
	if bpffs := agentArg(t, c, "bpffs"); bpffs != m.MountPath {
		t.Fatalf("deploy/daemonset.yaml: agent pins under --bpffs=%s, but the pin directory is mounted at %s", bpffs, m.MountPath)
	}
	return m.MountPath
}

// podCgroupMount checks that the DaemonSet mounts the node's cgroup file
// system read-only at the path the agent attaches its socket hooks under
// (--cgroup-root), and returns that path.
func podCgroupMount(t testing.TB) string {
	t.Helper()
	checkHostPaths(t)
	_, c := agentDaemonSet(t)
	m := hostMount(t, nodeCgroupDir, v1.HostPathDirectory)
	if !m.ReadOnly {
		t.Errorf("deploy/daemonset.yaml: %s mounted read-write, want readOnly (attaching writes nothing)", nodeCgroupDir)
	}
	if root := agentArg(t, c, "cgroup-root"); root != m.MountPath {
		t.Fatalf("deploy/daemonset.yaml: agent attaches under --cgroup-root=%s, but the node's cgroup file system is mounted at %s", root, m.MountPath)
	}
	return m.MountPath
}

// TestDaemonSetMounts checks the DaemonSet's two host mounts: see
// podPinMount and podCgroupMount. TestCapabilities runs the agent with
// exactly this layout.
func TestDaemonSetMounts(t *testing.T) {
	// A directory of the container's sysfs that exists: the runtime
	// cannot create a mount point in sysfs (mkdir there fails), so
	// /sys/fs/bpf/topolb in the pod would fail every container start.
	if got := podPinMount(t); got != "/sys/fs/bpf" {
		t.Errorf("pin directory mounted at %s, want /sys/fs/bpf", got)
	}
	if got := podCgroupMount(t); got == nodeCgroupDir || strings.HasPrefix(got, nodeCgroupDir+"/") {
		t.Errorf("cgroup file system mounted at %s: over the pod's own cgroup mount, which the runtime owns", got)
	}
}

// TestDaemonSetMetricsAndProbes checks what the DaemonSet exposes: metrics
// on the loopback address unless the ConfigMap opts in to the node's IP (off
// by default), /healthz as liveness and startup probe and /readyz as
// readiness on the loopback address, and every $(VAR) in the arguments
// defined, since an undefined one reaches the agent literally.
func TestDaemonSetMetricsAndProbes(t *testing.T) {
	_, c := agentDaemonSet(t)
	cfg := agentConfig(t)

	host, _, err := net.SplitHostPort(agentArg(t, c, "metrics-address"))
	if err != nil {
		t.Fatalf("--metrics-address: %v", err)
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		t.Errorf("--metrics-address host %q, want a loopback address", host)
	}
	if got := agentArg(t, c, "metrics-on-node-ip"); got != "$(TOPOLB_METRICS_ON_NODE_IP)" {
		t.Errorf("--metrics-on-node-ip=%s, want it from the ConfigMap's TOPOLB_METRICS_ON_NODE_IP", got)
	}
	if got := cfg["TOPOLB_METRICS_ON_NODE_IP"]; got != "false" {
		t.Errorf("ConfigMap TOPOLB_METRICS_ON_NODE_IP = %q, want \"false\" (opt-in)", got)
	}

	probes := []struct {
		name  string
		probe *v1.Probe
		path  string
	}{
		{"liveness", c.LivenessProbe, "/healthz"},
		{"startup", c.StartupProbe, "/healthz"},
		{"readiness", c.ReadinessProbe, "/readyz"},
	}
	health := agentArg(t, c, "health-address")
	for _, p := range probes {
		if p.probe == nil || p.probe.HTTPGet == nil {
			t.Errorf("no HTTP %s probe", p.name)
			continue
		}
		g := p.probe.HTTPGet
		if g.Path != p.path || g.Host != "127.0.0.1" || health != "127.0.0.1:"+g.Port.String() {
			t.Errorf("%s probe %s:%s%s, want 127.0.0.1 at --health-address %s, path %s", p.name, g.Host, g.Port.String(), g.Path, health, p.path)
		}
	}

	defined := map[string]bool{}
	for k := range cfg {
		defined[k] = true
	}
	for _, e := range c.Env {
		defined[e.Name] = true
	}
	ref := regexp.MustCompile(`\$\(([A-Z0-9_]+)\)`)
	for _, a := range c.Args {
		for _, m := range ref.FindAllStringSubmatch(a, -1) {
			if !defined[m[1]] {
				t.Errorf("argument %s refers to $(%s), which neither the ConfigMap nor env defines", a, m[1])
			}
		}
	}
	if !slices.ContainsFunc(c.Env, func(e v1.EnvVar) bool { return e.Name == "NODE_IP" && e.ValueFrom != nil }) {
		t.Error("no NODE_IP from the downward API, which --metrics-on-node-ip reads")
	}
}
