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

// podPinMount checks that the DaemonSet mounts exactly the node's
// /sys/fs/bpf/topolb (created if missing), and at the path the agent pins
// under (--bpffs), and returns that path.
func podPinMount(t testing.TB) string {
	t.Helper()
	ds, c := agentDaemonSet(t)
	var hostPaths []v1.Volume
	for _, v := range ds.Spec.Template.Spec.Volumes {
		if v.HostPath != nil {
			hostPaths = append(hostPaths, v)
		}
	}
	if len(hostPaths) != 1 {
		t.Fatalf("deploy/daemonset.yaml: %d hostPath volumes, want one (the pin directory)", len(hostPaths))
	}
	vol := hostPaths[0]
	if vol.HostPath.Path != nodePinDir {
		t.Fatalf("deploy/daemonset.yaml: hostPath %s, want only the pin directory %s", vol.HostPath.Path, nodePinDir)
	}
	if vol.HostPath.Type == nil || *vol.HostPath.Type != v1.HostPathDirectoryOrCreate {
		t.Errorf("deploy/daemonset.yaml: hostPath type %v, want DirectoryOrCreate (the kubelet creates it on the node's bpffs)", vol.HostPath.Type)
	}
	var mountPath string
	for _, m := range c.VolumeMounts {
		if m.Name == vol.Name {
			if mountPath != "" {
				t.Fatalf("deploy/daemonset.yaml: volume %s mounted twice", vol.Name)
			}
			mountPath = m.MountPath
			if m.MountPropagation != nil && *m.MountPropagation != v1.MountPropagationNone {
				t.Errorf("deploy/daemonset.yaml: pin directory mounted with %s propagation, want none", *m.MountPropagation)
			}
		}
	}
	if mountPath == "" {
		t.Fatalf("deploy/daemonset.yaml: volume %s is not mounted", vol.Name)
	}
	if bpffs := agentArg(t, c, "bpffs"); bpffs != mountPath {
		t.Fatalf("deploy/daemonset.yaml: agent pins under --bpffs=%s, but the pin directory is mounted at %s", bpffs, mountPath)
	}
	return mountPath
}

// TestDaemonSetMounts checks the DaemonSet's one host mount: see
// podPinMount. TestCapabilities runs the agent with exactly this layout.
func TestDaemonSetMounts(t *testing.T) {
	if got := podPinMount(t); got != nodePinDir {
		t.Errorf("pin directory mounted at %s, want %s (the agent's default and the README's path)", got, nodePinDir)
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
