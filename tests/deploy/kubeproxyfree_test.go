package deploy

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestKubeProxyFreeSettings checks the two ConfigMap settings that decide
// how topolb sits next to kube-proxy or replaces it, and that both reach
// the agent: the socket hooks for host-network clients (on by default;
// without them the node's own processes need kube-proxy), and the API
// server's own address (empty by default: through the `kubernetes`
// Service, which only kube-proxy translates before the agent runs), and
// kube-proxy's health port (off by default: kube-proxy holds it). And that
// the kind script has its kube-proxy-free variant, which sets both.
func TestKubeProxyFreeSettings(t *testing.T) {
	_, c := agentDaemonSet(t)
	cfg := agentConfig(t)
	for _, x := range []struct{ flag, key, want string }{
		{"host-services", "TOPOLB_HOST_SERVICES", "true"},
		{"apiserver", "TOPOLB_APISERVER", ""},
		// kube-proxy holds 10256 beside topolb: off unless it is gone.
		{"healthz-bind-address", "TOPOLB_HEALTHZ_BIND_ADDRESS", ""},
	} {
		if got := agentArg(t, c, x.flag); got != "$("+x.key+")" {
			t.Errorf("--%s=%s, want it from the ConfigMap's %s", x.flag, got, x.key)
		}
		if got, ok := cfg[x.key]; !ok || got != x.want {
			t.Errorf("ConfigMap %s = %q (present %v), want %q", x.key, got, ok, x.want)
		}
	}
	script, err := os.ReadFile(filepath.Join(repoRoot(t), "tests", "kind", "run.sh"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"kubeProxyMode: none", "TOPOLB_APISERVER", `TOPOLB_HEALTHZ_BIND_ADDRESS: "0.0.0.0:10256"`} {
		if !strings.Contains(string(script), want) {
			t.Errorf("tests/kind/run.sh has no %q: the kube-proxy-free variant is missing", want)
		}
	}
}
