package testbed

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// KubeProxyMode is kube-proxy's --proxy-mode. IPVS is not offered: it
// needs kernel modules this machine does not have.
type KubeProxyMode string

const (
	KubeProxyNFTables KubeProxyMode = "nftables"
	KubeProxyIPTables KubeProxyMode = "iptables"
)

// kube-proxy's addresses inside its node's namespace.
const (
	KubeProxyHealthAddress  = "127.0.0.1:10256"
	KubeProxyMetricsAddress = "127.0.0.1:10249"
)

// KubeProxy is a kube-proxy process in a node's namespace, watching the
// connected apiserver, in place of topolb. Its rules stay when it exits;
// they go with the namespace.
type KubeProxy struct {
	*Process
	Mode KubeProxyMode
	http *http.Client
}

// KubeProxyOptions configure StartKubeProxy.
type KubeProxyOptions struct {
	// Binary is the kube-proxy executable.
	Binary string
	Mode   KubeProxyMode
	// Verbosity is passed as -v; below 4 EnsureTopology cannot tell
	// whether kube-proxy learnt its zone. Zero means 4.
	Verbosity int
	// NodePortAddresses is its --nodeport-addresses; empty means
	// "primary" (the Node's primary address).
	NodePortAddresses string
}

// StartKubeProxy starts kube-proxy on the named node and waits until it
// has written its rules once. It needs an apiserver (ConnectAPIServer); the
// testbed stops it on Close. See EnsureTopology before relying on its
// topology decisions.
func (tb *Testbed) StartKubeProxy(ctx context.Context, node string, o KubeProxyOptions) (*KubeProxy, error) {
	n := tb.Node(node)
	if n == nil {
		return nil, fmt.Errorf("no node %q", node)
	}
	if tb.Spec.KubeProxy == KubeProxyNone {
		return nil, errors.New("the spec says kubeProxy: none")
	}
	kubeconfig := tb.kubeconfigFor(node)
	if kubeconfig == "" {
		return nil, errors.New("kube-proxy needs an apiserver: ConnectAPIServer first")
	}
	bin, err := filepath.Abs(o.Binary)
	if err != nil {
		return nil, err
	}
	if o.Verbosity == 0 {
		o.Verbosity = 4
	}
	if o.NodePortAddresses == "" {
		o.NodePortAddresses = "primary"
	}
	mode := o.Mode
	// Both families' pod ranges in a dual-stack testbed: kube-proxy then
	// runs a proxier per family.
	clusterCIDR := tb.Spec.PodCIDR
	if tb.Spec.DualStack {
		clusterCIDR += "," + DefaultPodCIDR6
	}
	k := &KubeProxy{
		Process: newNodeProcess(tb, n, "kube-proxy-"+string(mode), bin),
		Mode:    mode,
		http: &http.Client{
			Timeout:   5 * time.Second,
			Transport: &http.Transport{DialContext: n.NS.DialContext, DisableKeepAlives: true},
		},
	}
	k.args = func() []string {
		return []string{
			"--kubeconfig", kubeconfig,
			"--hostname-override", n.Name,
			"--proxy-mode", string(mode),
			"--cluster-cidr", clusterCIDR,
			// 0 leaves the (global) conntrack sysctls alone.
			"--conntrack-max-per-core", "0",
			"--nodeport-addresses", o.NodePortAddresses,
			"--healthz-bind-address", KubeProxyHealthAddress,
			"--metrics-bind-address", KubeProxyMetricsAddress,
			"-v", strconv.Itoa(o.Verbosity),
		}
	}
	tb.mu.Lock()
	switch {
	case tb.closed:
		err = errors.New("testbed closed")
	default:
		tb.proxies = append(tb.proxies, k)
	}
	tb.mu.Unlock()
	if err != nil {
		return nil, err
	}
	if err := k.Start(ctx); err != nil {
		return nil, err
	}
	return k, k.WaitReady(ctx)
}

// WaitReady waits until kube-proxy has written its rules once: its
// kubeproxy_sync_proxy_rules_last_timestamp_seconds metric is set. (Its
// /healthz answers 200 before the first sync.)
func (k *KubeProxy) WaitReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	done := k.doneChan()
	var last error
	for {
		synced, err := k.synced(ctx)
		if synced {
			return nil
		}
		last = err
		select {
		case <-done:
			return fmt.Errorf("kube-proxy on %s exited before it was ready (%v); last log lines:\n%s", k.Node.Name, k.ExitError(), k.LogTail(20))
		case <-ctx.Done():
			return fmt.Errorf("kube-proxy on %s not ready: %w (last: %v); last log lines:\n%s", k.Node.Name, ctx.Err(), last, k.LogTail(20))
		case <-time.After(100 * time.Millisecond):
		}
	}
}

var syncedMetric = regexp.MustCompile(`(?m)^kubeproxy_sync_proxy_rules_last_timestamp_seconds(?:\{ip_family="IPv4"\})? ([0-9.e+]+)$`)

// synced reports whether kube-proxy's metrics show a completed sync.
func (k *KubeProxy) synced(ctx context.Context) (bool, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+KubeProxyMetricsAddress+"/metrics", nil)
	resp, err := k.http.Do(req)
	if err != nil {
		return false, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return false, err
	}
	m := syncedMetric.FindSubmatch(body)
	if m == nil {
		return false, errors.New("no sync yet")
	}
	v, err := strconv.ParseFloat(string(m[1]), 64)
	return err == nil && v > 0, err
}

// topologyLogged is what kube-proxy logs (at -v 4) when its proxier learns
// the node's topology labels.
const topologyLogged = "Updated proxier node topology labels"

// EnsureTopology works around a race in kube-proxy v1.37.2: its server
// adds the node-topology handler to the already running node informer
// and only then registers the proxier with it
// (cmd/kube-proxy/app/server.go, NewNodeTopologyConfig then
// RegisterEventHandler), so when the informer replays the node in between,
// the proxier never hears of its zone, and later events with the same
// labels are dropped as no change. Such a kube-proxy ignores zone hints
// until the node's zone label changes. If the log does not show the labels
// arriving, EnsureTopology changes the node's zone label in the apiserver
// and back, and waits until kube-proxy logs them with the node's own zone
// (the first log line carries the temporary zone). It reports whether the
// workaround was needed. Needs -v 4.
func (k *KubeProxy) EnsureTopology(ctx context.Context) (bool, error) {
	// The replay comes within milliseconds of the start; give it two
	// seconds before calling it lost.
	grace := time.Now().Add(2 * time.Second)
	for !k.knowsZone() {
		if time.Now().After(grace) {
			return k.relabel(ctx)
		}
		select {
		case <-ctx.Done():
			return false, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	return false, nil
}

// relabel changes the node's zone label and back, and waits until
// kube-proxy logs its topology labels.
func (k *KubeProxy) relabel(ctx context.Context) (bool, error) {
	c := k.tb.KubeClient()
	if c == nil {
		return false, errors.New("no apiserver")
	}
	api := c.CoreV1().Nodes()
	for _, zone := range []string{k.Node.Zone + "-relabel", k.Node.Zone} {
		node, err := api.Get(ctx, k.Node.Name, metav1.GetOptions{})
		if err != nil {
			return true, fmt.Errorf("get node %s: %w", k.Node.Name, err)
		}
		node.Labels[v1.LabelTopologyZone] = zone
		if _, err := api.Update(ctx, node, metav1.UpdateOptions{}); err != nil {
			return true, fmt.Errorf("relabel node %s: %w", k.Node.Name, err)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for !k.knowsZone() {
		if time.Now().After(deadline) {
			return true, fmt.Errorf("kube-proxy on %s did not log %q after its zone label changed", k.Node.Name, topologyLogged)
		}
		select {
		case <-ctx.Done():
			return true, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	return true, nil
}

// knowsZone reports whether the last topology labels kube-proxy logged
// for IPv4 carry its node's zone (not the temporary one of relabel).
func (k *KubeProxy) knowsZone() bool {
	last := ""
	for _, line := range strings.Split(k.logText(), "\n") {
		if strings.Contains(line, topologyLogged) && strings.Contains(line, `ipFamily="IPv4"`) {
			last = line
		}
	}
	return strings.Contains(last, fmt.Sprintf("%q:%q", v1.LabelTopologyZone, k.Node.Zone))
}

// logText returns the log of the current process (since its last start).
func (k *KubeProxy) logText() string {
	data, err := os.ReadFile(k.LogPath)
	if err != nil {
		return ""
	}
	s := string(data)
	if i := strings.LastIndex(s, "==== "); i >= 0 {
		s = s[i:]
	}
	return s
}

// PortKey names one service port: "namespace/name/port/PROTO", with the
// port's name ("" for an unnamed port).
func PortKey(service, port string, proto v1.Protocol) string {
	return qualify(service) + "/" + port + "/" + string(proto)
}

// Ruleset returns kube-proxy's rules of family as its mode's tool prints
// them: `nft list table ip kube-proxy` (ip6 for IPv6) or `iptables-save`
// (IPv4 only: its IPv6 rules are not read).
func (k *KubeProxy) Ruleset(ctx context.Context, family v1.IPFamily) ([]byte, error) {
	var args []string
	switch {
	case k.Mode == KubeProxyNFTables:
		args = []string{"nft", "list", "table", pick(family, "ip", "ip6"), "kube-proxy"}
	case k.Mode == KubeProxyIPTables && family == v1.IPv6Protocol:
		return nil, errors.New("kube-proxy's IPv6 rules are read in nftables mode only")
	case k.Mode == KubeProxyIPTables:
		args = []string{"iptables-save"}
	default:
		return nil, fmt.Errorf("kube-proxy mode %q", k.Mode)
	}
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, "nsenter", append([]string{"--net=" + k.Node.NS.Path}, args...)...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("%s on %s: %w: %s", strings.Join(args, " "), k.Node.Name, err, bytes.TrimSpace(stderr.Bytes()))
	}
	return out, nil
}

// Frontends reads every frontend kube-proxy programmed on its node —
// cluster IPs, external IPs, load-balancer IPs and NodePorts on its
// nodeport addresses — with the endpoints a packet from the source address
// `from` can be translated to, by FrontendKey ("ip:port/PROTO", the keys of
// AgentState.Programmed); the "ip:port" lists are sorted. The source
// matters where kube-proxy branches on it (externalTrafficPolicy Local
// sends pods to the cluster-wide set and others to the local one). A
// frontend kube-proxy rejects or drops has an empty list. It follows the
// rules from where packets enter, not names or comments, in the table of
// from's family (IPv6: nftables mode only).
func (k *KubeProxy) Frontends(ctx context.Context, from netip.Addr) (map[string][]string, error) {
	rules, err := k.Ruleset(ctx, familyOf(from))
	if err != nil {
		return nil, err
	}
	var fes map[string][]string
	if k.Mode == KubeProxyNFTables {
		fes, err = nftFrontends(rules, from)
	} else {
		fes, err = iptFrontends(rules, from)
	}
	if err != nil {
		return nil, fmt.Errorf("kube-proxy %s on %s: %w", k.Mode, k.Node.Name, err)
	}
	return fes, nil
}

// KubeProxies returns the kube-proxies the testbed started.
func (tb *Testbed) KubeProxies() []*KubeProxy {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	return slices.Clone(tb.proxies)
}
