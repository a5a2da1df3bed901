package deploy

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	apiyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"github.com/topolb/topolb/internal/kubetest"
)

const (
	// envHelmBins names the directory holding the helm binary
	// tools/helm-bin.sh builds (the Makefile exports it); unset, it is
	// the per-user cache the Makefile fills by default.
	envHelmBins = "TOPOLB_HELM_BINS"
	// helmVersion is the Helm release the Makefile builds (HELM_VERSION).
	helmVersion = "v4.3.1"
	// chartNamespace is the namespace deploy/ installs into, and the one
	// the chart is rendered for.
	chartNamespace = "topolb-system"
)

// chartDir is the chart in the repository.
func chartDir(t testing.TB) string { return filepath.Join(deployDir(t), "helm", "topolb") }

// requireTool returns path if it is an executable, and otherwise skips t,
// or fails it under TOPOLB_KUBE_REQUIRED (make test), which builds every
// tool first.
func requireTool(t testing.TB, path, how string) string {
	t.Helper()
	if fi, err := os.Stat(path); err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
		if os.Getenv(kubetest.EnvRequired) != "" {
			t.Fatalf("no executable %s (%s; %s is set)", path, how, kubetest.EnvRequired)
		}
		t.Skipf("no executable %s (%s)", path, how)
	}
	return path
}

// helmBinary is tools/helm-bin.sh's helm: in $TOPOLB_HELM_BINS, else in
// the cache `make helm-bin` fills.
func helmBinary(t testing.TB) string {
	t.Helper()
	dir := os.Getenv(envHelmBins)
	if dir == "" {
		cache, err := os.UserCacheDir()
		if err != nil {
			t.Fatal(err)
		}
		dir = filepath.Join(cache, "topolb", "helm-"+helmVersion)
	}
	return requireTool(t, filepath.Join(dir, "helm"), "make helm-bin builds it")
}

// kubectlBinary is kubectl from the kube binaries (make kube-bins).
func kubectlBinary(t testing.TB) string {
	t.Helper()
	dir, err := kubetest.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	return requireTool(t, filepath.Join(dir, "kubectl"), "make kube-bins builds it")
}

// run runs a command and returns its standard output, failing t with its
// standard error when it fails.
func run(t testing.TB, name string, args ...string) []byte {
	t.Helper()
	out, err := runErr(name, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// runErr runs a command and returns its standard output, or an error that
// holds its standard error.
func runErr(name string, args ...string) ([]byte, error) {
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(name, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.Bytes(), fmt.Errorf("%s %s: %w\n%s", filepath.Base(name), strings.Join(args, " "), err, stderr.String())
	}
	return stdout.Bytes(), nil
}

// helmTemplate renders the chart in chartNamespace with the given extra
// arguments (--set ...).
func helmTemplate(t testing.TB, args ...string) ([]byte, error) {
	t.Helper()
	return runErr(helmBinary(t), append([]string{"template", "topolb", chartDir(t), "--namespace", chartNamespace}, args...)...)
}

// object is one Kubernetes object as decoded YAML.
type object = map[string]any

// decodeObjects splits a multi-document YAML stream into objects keyed by
// kind/namespace/name, failing on a duplicate key.
func decodeObjects(t testing.TB, what string, data []byte) map[string]object {
	t.Helper()
	objs := map[string]object{}
	dec := apiyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	for {
		var o object
		if err := dec.Decode(&o); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if o == nil {
			continue
		}
		md, _ := o["metadata"].(map[string]any)
		key := fmt.Sprintf("%v/%v/%v", o["kind"], md["namespace"], md["name"])
		if _, dup := objs[key]; dup {
			t.Fatalf("%s: %s twice", what, key)
		}
		objs[key] = o
	}
	return objs
}

// agentContainer returns the agent container of the DaemonSet in objs.
func agentContainer(t testing.TB, objs map[string]object) map[string]any {
	t.Helper()
	ds, ok := objs["DaemonSet/"+chartNamespace+"/topolb-agent"]
	if !ok {
		t.Fatal("no DaemonSet topolb-agent")
	}
	var c map[string]any
	walk(ds, []string{"spec", "template", "spec", "containers"}, func(v any) {
		for _, x := range v.([]any) {
			if m := x.(map[string]any); m["name"] == "agent" {
				c = m
			}
		}
	})
	if c == nil {
		t.Fatal("DaemonSet topolb-agent: no container named agent")
	}
	return c
}

// walk calls f with the value at path in o, if there is one.
func walk(o any, path []string, f func(any)) {
	for _, p := range path {
		m, ok := o.(map[string]any)
		if !ok {
			return
		}
		if o, ok = m[p]; !ok {
			return
		}
	}
	f(o)
}

// normalizeArgs sorts the agent's arguments in place and reports any
// flag given twice: the agent's flags are named, so their order means
// nothing, and a flag given twice would (the last one wins).
func normalizeArgs(t testing.TB, what string, c map[string]any) {
	t.Helper()
	raw, _ := c["args"].([]any)
	seen := map[string]bool{}
	for _, a := range raw {
		name, _, _ := strings.Cut(fmt.Sprint(a), "=")
		if seen[name] {
			t.Errorf("%s: %s given twice", what, name)
		}
		seen[name] = true
	}
	sort.Slice(raw, func(i, j int) bool { return fmt.Sprint(raw[i]) < fmt.Sprint(raw[j]) })
}

// diff lists the paths at which a and b differ.
func diff(path string, a, b any) []string {
	am, aok := a.(map[string]any)
	bm, bok := b.(map[string]any)
	if aok && bok {
		var out []string
		keys := map[string]bool{}
		for k := range am {
			keys[k] = true
		}
		for k := range bm {
			keys[k] = true
		}
		for _, k := range slices.Sorted(func(yield func(string) bool) {
			for k := range keys {
				if !yield(k) {
					return
				}
			}
		}) {
			out = append(out, diff(path+"."+k, am[k], bm[k])...)
		}
		return out
	}
	al, aok := a.([]any)
	bl, bok := b.([]any)
	if aok && bok && len(al) == len(bl) {
		var out []string
		for i := range al {
			out = append(out, diff(fmt.Sprintf("%s[%d]", path, i), al[i], bl[i])...)
		}
		return out
	}
	if reflect.DeepEqual(a, b) {
		return nil
	}
	return []string{fmt.Sprintf("%s: kustomize %s, helm %s", path, jsonish(a), jsonish(b))}
}

func jsonish(v any) string {
	if v == nil {
		return "(absent)"
	}
	out, err := yaml.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	return strings.TrimSpace(string(out))
}

// TestChartLint: `helm lint --strict` passes on the chart with its
// defaults and as the kube-proxy-free variant.
func TestChartLint(t *testing.T) {
	helm := helmBinary(t)
	for _, c := range []struct {
		name string
		args []string
	}{
		{"defaults", nil},
		{"kube-proxy-free", []string{"--set", "variant=kube-proxy-free", "--set", "config.apiserver=10.0.0.1:6443"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			out := run(t, helm, append([]string{"lint", "--strict", chartDir(t), "--namespace", chartNamespace}, c.args...)...)
			if !bytes.Contains(out, []byte("0 chart(s) failed")) || bytes.Contains(out, []byte("[WARNING]")) || bytes.Contains(out, []byte("[ERROR]")) {
				t.Errorf("helm lint:\n%s", out)
			}
		})
	}
}

// TestChartMatchesKustomize: the chart with its default values renders
// the same objects as `kubectl kustomize deploy/`, compared as decoded
// objects (comments, order of keys and of documents aside; the agent's
// arguments compared as a set, see normalizeArgs).
func TestChartMatchesKustomize(t *testing.T) {
	kustomized := decodeObjects(t, "kubectl kustomize deploy/", run(t, kubectlBinary(t), "kustomize", deployDir(t)))
	out, err := helmTemplate(t)
	if err != nil {
		t.Fatal(err)
	}
	rendered := decodeObjects(t, "helm template", out)
	normalizeArgs(t, "kustomize", agentContainer(t, kustomized))
	normalizeArgs(t, "helm", agentContainer(t, rendered))
	for key, want := range kustomized {
		got, ok := rendered[key]
		if !ok {
			t.Errorf("%s: rendered by kustomize, not by the chart", key)
			continue
		}
		for _, d := range diff("", want, got) {
			t.Errorf("%s%s", key, d)
		}
	}
	for key := range rendered {
		if _, ok := kustomized[key]; !ok {
			t.Errorf("%s: rendered by the chart, not by kustomize", key)
		}
	}
	if len(kustomized) < 8 {
		t.Errorf("kustomize rendered %d objects, want at least the 8 of deploy/kustomization.yaml", len(kustomized))
	}
}

// chartValues reads the chart's values.yaml.
func chartValues(t testing.TB) map[string]any {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(chartDir(t), "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var v map[string]any
	if err := yaml.Unmarshal(data, &v); err != nil {
		t.Fatalf("values.yaml: %v", err)
	}
	return v
}

// chartFixedFlags are the agent's flags the chart sets without a value of
// their own, and why; every other flag must be a value.
var chartFixedFlags = map[string]string{
	"bpffs":               "the pod's mount point of hostPaths.bpffs",
	"cgroup-root":         "the pod's mount point of hostPaths.cgroup",
	"node-name":           "$NODE_NAME, from the pod's spec.nodeName",
	"node-ip":             "$NODE_IP, from the pod's status.hostIP",
	"summary-namespace":   "$POD_NAMESPACE, from the pod's metadata.namespace",
	"kubeconfig":          "in a pod: the in-cluster configuration",
	"from-file":           "standalone mode, not for a cluster",
	"allow-empty-cluster": "standalone mode, not for a cluster",
	"help":                "not a setting",
}

// TestChartCoversEveryFlag: every flag of topolb-agent (from its --help)
// is a value of the chart (config or flags) or one the chart sets itself
// (chartFixedFlags), and every value names a flag the agent has. A flag
// added to the agent fails here until values.yaml has a line for it.
func TestChartCoversEveryFlag(t *testing.T) {
	help := run(t, agentBinary(t), "--help")
	flagRE := regexp.MustCompile(`(?m)^\s+(?:-[a-zA-Z], )?--([a-z0-9][a-z0-9-]*)`)
	agentFlags := map[string]bool{}
	for _, m := range flagRE.FindAllSubmatch(help, -1) {
		agentFlags[string(m[1])] = true
	}
	if len(agentFlags) < 20 {
		t.Fatalf("found %d flags in topolb-agent --help, expected more:\n%s", len(agentFlags), help)
	}
	values := chartValues(t)
	inChart := map[string]string{}
	for _, section := range []string{"config", "flags"} {
		m, ok := values[section].(map[string]any)
		if !ok {
			t.Fatalf("values.yaml: no map %s", section)
		}
		for flag := range m {
			if prev, dup := inChart[flag]; dup {
				t.Errorf("values.yaml: --%s in both %s and %s", flag, prev, section)
			}
			inChart[flag] = section
			if !agentFlags[flag] {
				t.Errorf("values.yaml %s.%s: topolb-agent has no flag --%s", section, flag, flag)
			}
		}
	}
	for flag := range chartFixedFlags {
		if !agentFlags[flag] {
			t.Errorf("chartFixedFlags names --%s, which topolb-agent does not have", flag)
		}
		if s, ok := inChart[flag]; ok {
			t.Errorf("--%s is set by the chart, and also a value in %s", flag, s)
		}
	}
	for flag := range agentFlags {
		if _, ok := inChart[flag]; !ok && chartFixedFlags[flag] == "" {
			t.Errorf("topolb-agent --%s is not a value of the chart: add it to values.yaml's flags (null: the agent's default) or config", flag)
		}
	}
}

// configMapData returns the ConfigMap's data of a rendering.
func configMapData(t testing.TB, objs map[string]object) map[string]any {
	t.Helper()
	cm, ok := objs["ConfigMap/"+chartNamespace+"/topolb-agent"]
	if !ok {
		t.Fatal("no ConfigMap topolb-agent")
	}
	data, _ := cm["data"].(map[string]any)
	return data
}

// TestChartValues renders the chart with values other than the defaults:
// the kube-proxy-free variant, the metrics opt-in, flags and config set,
// scheduling and resources; and refuses what cannot work with a message
// that names the value.
func TestChartValues(t *testing.T) {
	for _, c := range []struct {
		name string
		args []string
		// config and args are ConfigMap entries and agent arguments the
		// rendering must hold; absent are arguments it must not.
		config map[string]string
		args2  []string
		absent []string
		// check looks at the rendering.
		check func(t *testing.T, objs map[string]object)
		// fails is what the error must say; empty: must render.
		fails string
	}{
		{
			name:   "kube-proxy-free",
			args:   []string{"--set", "variant=kube-proxy-free", "--set", "config.apiserver=10.0.0.1:6443"},
			config: map[string]string{"TOPOLB_APISERVER": "10.0.0.1:6443", "TOPOLB_HEALTHZ_BIND_ADDRESS": "0.0.0.0:10256", "TOPOLB_HOST_SERVICES": "true"},
			args2:  []string{"--apiserver=$(TOPOLB_APISERVER)", "--healthz-bind-address=$(TOPOLB_HEALTHZ_BIND_ADDRESS)"},
		},
		{
			name:   "kube-proxy-free on another health port",
			args:   []string{"--set", "variant=kube-proxy-free", "--set", "config.apiserver=10.0.0.1:6443", "--set", "config.healthz-bind-address=0.0.0.0:10257"},
			config: map[string]string{"TOPOLB_HEALTHZ_BIND_ADDRESS": "0.0.0.0:10257"},
		},
		{name: "kube-proxy-free without the API server's address", args: []string{"--set", "variant=kube-proxy-free"}, fails: "config.apiserver"},
		{name: "kube-proxy-free without host services", args: []string{"--set", "variant=kube-proxy-free", "--set", "config.apiserver=10.0.0.1:6443", "--set", "config.host-services=false"}, fails: "config.host-services"},
		{name: "unknown variant", args: []string{"--set", "variant=none"}, fails: `variant "none"`},
		{name: "the default namespace", args: []string{"--namespace", "default"}, fails: "its own namespace"},
		{name: "a flag in config and flags", args: []string{"--set", "flags.uplinks=eth0"}, fails: "both in config and in flags"},
		{
			name:   "a config value set to null",
			args:   []string{"--set", "config.uplinks=null"},
			absent: []string{"--uplinks"},
			check: func(t *testing.T, objs map[string]object) {
				if v, ok := configMapData(t, objs)["TOPOLB_UPLINKS"]; ok {
					t.Errorf("ConfigMap TOPOLB_UPLINKS = %v, want it left out with the flag", v)
				}
			},
		},
		{
			name:   "metrics on the node's IP",
			args:   []string{"--set", "config.metrics-on-node-ip=true"},
			config: map[string]string{"TOPOLB_METRICS_ON_NODE_IP": "true"},
			check: func(t *testing.T, objs map[string]object) {
				walk(objs["DaemonSet/"+chartNamespace+"/topolb-agent"], []string{"spec", "template", "metadata", "annotations"}, func(v any) {
					want := map[string]any{"prometheus.io/scrape": "true", "prometheus.io/port": "9965", "prometheus.io/path": "/metrics"}
					if !reflect.DeepEqual(v, want) {
						t.Errorf("pod annotations %v, want %v", v, want)
					}
				})
			},
		},
		{
			name: "flags, large numbers and lists",
			args: []string{
				"--set", "config.max-conntrack=1048576", "--set", "config.v=4",
				"--set", "flags.snat-ports=20000-29999", "--set", "flags.verify-interval=30s",
				"--set", "flags.nodeport-addresses={10.0.0.0/8,192.168.0.0/16}",
				"--set", "flags.health-address=127.0.0.1:19966", "--set", "flags.metrics-address=127.0.0.1:19965",
			},
			config: map[string]string{"TOPOLB_MAX_CONNTRACK": "1048576", "TOPOLB_VERBOSITY": "4"},
			args2: []string{"--snat-ports=20000-29999", "--verify-interval=30s", "--nodeport-addresses=10.0.0.0/8,192.168.0.0/16",
				"--health-address=127.0.0.1:19966", "--metrics-address=127.0.0.1:19965", "--v=$(TOPOLB_VERBOSITY)"},
			absent: []string{"--health-timeout", "--sync-coalesce"},
			check: func(t *testing.T, objs map[string]object) {
				c := agentContainer(t, objs)
				for _, probe := range []string{"startupProbe", "livenessProbe", "readinessProbe"} {
					walk(c, []string{probe, "httpGet", "port"}, func(v any) {
						if fmt.Sprint(v) != "19966" {
							t.Errorf("%s port %v, want --health-address's 19966", probe, v)
						}
					})
				}
				walk(c, []string{"ports"}, func(v any) {
					if p := v.([]any)[0].(map[string]any)["containerPort"]; fmt.Sprint(p) != "19965" {
						t.Errorf("metrics containerPort %v, want --metrics-address's 19965", p)
					}
				})
			},
		},
		{
			name: "scheduling, resources, image",
			args: []string{"--set", "tolerations=null", "--set", "priorityClassName=", "--set", "resources.limits.memory=2Gi",
				"--set", "image.repository=registry.example/topolb", "--set", "image.tag=v1.2.3", "--set", "commonLabels.team=net"},
			check: func(t *testing.T, objs map[string]object) {
				ds := objs["DaemonSet/"+chartNamespace+"/topolb-agent"]
				walk(ds, []string{"spec", "template", "spec"}, func(v any) {
					spec := v.(map[string]any)
					for _, k := range []string{"tolerations", "priorityClassName"} {
						if _, ok := spec[k]; ok {
							t.Errorf("pod spec has %s %v, want it left out", k, spec[k])
						}
					}
				})
				c := agentContainer(t, objs)
				if c["image"] != "registry.example/topolb:v1.2.3" {
					t.Errorf("image %v", c["image"])
				}
				walk(c, []string{"resources", "limits", "memory"}, func(v any) {
					if v != "2Gi" {
						t.Errorf("memory limit %v, want 2Gi", v)
					}
				})
				for key, o := range objs {
					walk(o, []string{"metadata", "labels", "team"}, func(v any) {
						if v != "net" {
							t.Errorf("%s: label team=%v", key, v)
						}
					})
					if _, ok := o["metadata"].(map[string]any)["labels"].(map[string]any)["team"]; !ok {
						t.Errorf("%s: no commonLabels", key)
					}
				}
			},
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			out, err := helmTemplate(t, c.args...)
			if c.fails != "" {
				if err == nil {
					t.Fatalf("rendered, want an error about %q", c.fails)
				}
				if !strings.Contains(err.Error(), c.fails) {
					t.Errorf("error does not say %q:\n%v", c.fails, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			objs := decodeObjects(t, "helm template", out)
			data := configMapData(t, objs)
			for k, want := range c.config {
				if got := fmt.Sprint(data[k]); got != want {
					t.Errorf("ConfigMap %s = %q, want %q", k, got, want)
				}
			}
			var args []string
			for _, a := range agentContainer(t, objs)["args"].([]any) {
				args = append(args, fmt.Sprint(a))
			}
			for _, want := range c.args2 {
				if !slices.Contains(args, want) {
					t.Errorf("agent arguments lack %s: %q", want, args)
				}
			}
			for _, flag := range c.absent {
				if slices.ContainsFunc(args, func(a string) bool { return strings.HasPrefix(a, flag+"=") }) {
					t.Errorf("agent arguments have %s, want it left to the agent's default: %q", flag, args)
				}
			}
			if c.check != nil {
				c.check(t, objs)
			}
		})
	}
}

// TestHelmVersion: the Makefile builds the helm these tests look for.
func TestHelmVersion(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(repoRoot(t), "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^HELM_VERSION \?= (\S+)$`).FindSubmatch(data)
	if m == nil || string(m[1]) != helmVersion {
		t.Errorf("Makefile's HELM_VERSION is %q, these tests look for helm %s", m, helmVersion)
	}
}

// TestServerSideDryRunChart applies the chart's renderings (its defaults,
// and the kube-proxy-free variant with the metrics opt-in and other
// values) with --dry-run=server to a real kube-apiserver, which validates
// and admits every object (Pod Security, priority classes) without
// persisting it, as TestServerSideDryRun does for deploy/.
func TestServerSideDryRunChart(t *testing.T) {
	helmBinary(t)
	kubectl := kubectlBinary(t)
	c := kubetest.Start(t)
	kube := func(args ...string) ([]byte, error) {
		return runErr(kubectl, append([]string{"--kubeconfig", c.KubeconfigPath}, args...)...)
	}
	if out, err := kube("apply", "-f", filepath.Join(deployDir(t), "namespace.yaml")); err != nil {
		t.Fatalf("create the namespace: %v\n%s", err, out)
	}
	for _, v := range []struct {
		name string
		args []string
	}{
		{"defaults", nil},
		{"kube-proxy-free", []string{"--set", "variant=kube-proxy-free", "--set", "config.apiserver=10.0.0.1:6443",
			"--set", "config.metrics-on-node-ip=true", "--set", "rollOnConfigChange=true", "--set", "flags.snat-ports=20000-29999",
			"--set", "flags.health-address=127.0.0.1:19966", "--set", "config.max-conntrack=1048576"}},
	} {
		t.Run(v.name, func(t *testing.T) {
			rendered, err := helmTemplate(t, v.args...)
			if err != nil {
				t.Fatal(err)
			}
			objects := len(decodeObjects(t, "helm template", rendered))
			file := filepath.Join(t.TempDir(), "rendered.yaml")
			if err := os.WriteFile(file, rendered, 0o644); err != nil {
				t.Fatal(err)
			}
			out, err := kube("apply", "--dry-run=server", "-f", file)
			if err != nil {
				t.Fatalf("kubectl apply --dry-run=server: %v\n%s", err, out)
			}
			lines := strings.Split(strings.TrimSpace(string(out)), "\n")
			for _, l := range lines {
				if !strings.HasSuffix(l, "(server dry run)") {
					t.Errorf("unexpected output line %q", l)
				}
			}
			if len(lines) != objects {
				t.Errorf("dry run reported %d objects, the chart renders %d:\n%s", len(lines), objects, out)
			}
		})
	}
}

// TestHelmInstall installs the chart with helm on a real kube-apiserver as
// deploy/README.md says (--create-namespace: helm keeps the release in
// the namespace, so it must exist first; the chart's Namespace object then
// labels it), upgrades it with another config value, which with
// rollOnConfigChange changes the pod template, and uninstalls it, which
// removes every object it created. (No node runs the DaemonSet's pods:
// the apiserver has no kubelet.)
func TestHelmInstall(t *testing.T) {
	helm := helmBinary(t)
	kubectl := kubectlBinary(t)
	c := kubetest.Start(t)
	h := func(args ...string) []byte {
		t.Helper()
		return run(t, helm, append([]string{"--kubeconfig", c.KubeconfigPath, "--namespace", chartNamespace}, args...)...)
	}
	getJSON := func(what string, out any) error {
		data, err := runErr(kubectl, "--kubeconfig", c.KubeconfigPath, "--namespace", chartNamespace, "get", what, "-o", "json")
		if err != nil {
			return err
		}
		return yaml.Unmarshal(data, out)
	}
	type podTemplate struct {
		Spec struct {
			Template struct {
				Metadata struct {
					Annotations map[string]string `json:"annotations"`
				} `json:"metadata"`
			} `json:"template"`
		} `json:"spec"`
	}
	checksum := func() string {
		t.Helper()
		var ds podTemplate
		if err := getJSON("daemonset/topolb-agent", &ds); err != nil {
			t.Fatal(err)
		}
		return ds.Spec.Template.Metadata.Annotations["checksum/config"]
	}

	h("install", "topolb", chartDir(t), "--create-namespace", "--set", "rollOnConfigChange=true")
	for _, what := range []string{"namespace/" + chartNamespace, "serviceaccount/topolb-agent", "clusterrole/topolb-agent",
		"clusterrolebinding/topolb-agent", "role/topolb-agent", "rolebinding/topolb-agent", "configmap/topolb-agent", "daemonset/topolb-agent"} {
		var o map[string]any
		if err := getJSON(what, &o); err != nil {
			t.Errorf("after helm install: %v", err)
		}
	}
	// The namespace --create-namespace made carries the chart's labels:
	// the Pod Security level the agent needs.
	var ns struct {
		Metadata struct {
			Labels map[string]string `json:"labels"`
		} `json:"metadata"`
	}
	if err := getJSON("namespace/"+chartNamespace, &ns); err != nil {
		t.Fatal(err)
	}
	if got := ns.Metadata.Labels["pod-security.kubernetes.io/enforce"]; got != "privileged" {
		t.Errorf("namespace labels %v, want pod-security.kubernetes.io/enforce=privileged", ns.Metadata.Labels)
	}
	before := checksum()
	if before == "" {
		t.Fatal("no checksum/config annotation with rollOnConfigChange")
	}

	h("upgrade", "topolb", chartDir(t), "--set", "rollOnConfigChange=true", "--set", "config.v=2")
	var cm struct {
		Data map[string]string `json:"data"`
	}
	if err := getJSON("configmap/topolb-agent", &cm); err != nil {
		t.Fatal(err)
	}
	if cm.Data["TOPOLB_VERBOSITY"] != "2" {
		t.Errorf("after helm upgrade, TOPOLB_VERBOSITY = %q, want 2", cm.Data["TOPOLB_VERBOSITY"])
	}
	if after := checksum(); after == before {
		t.Errorf("helm upgrade with another config value left the pod template's checksum at %s: the agents would not roll", after)
	}

	// Without --wait: the namespace stays Terminating here, where no
	// controller manager empties it.
	h("uninstall", "topolb")
	for _, what := range []string{"clusterrole/topolb-agent", "clusterrolebinding/topolb-agent"} {
		var o map[string]any
		if err := getJSON(what, &o); err == nil {
			t.Errorf("%s still there after helm uninstall", what)
		}
	}
}
