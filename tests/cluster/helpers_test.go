package cluster

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"

	"github.com/topolb/topolb/tools/cluster/echo/api"
)

const zoneLabel = "topology.kubernetes.io/zone"

// env is one run of the suite against one cluster.
type env struct {
	t          *testing.T
	cs         kubernetes.Interface
	kubeconfig string
	kubectl    string
	topolbctl  string
	echoImage  string
	ns         string
	zoneOf     map[string]string // node name -> zone
	nodeIP     map[string]string // node name -> InternalIP
	zones      []string          // sorted
}

// newEnv connects to the cluster named by $TOPOLB_E2E_KUBECONFIG (make
// test-cluster sets it; tests/kind/run.sh can too) and makes a namespace
// for the test, deleted afterwards.
func newEnv(t *testing.T) *env {
	t.Helper()
	kubeconfig := os.Getenv("TOPOLB_E2E_KUBECONFIG")
	if kubeconfig == "" {
		t.Skip("no cluster: set TOPOLB_E2E_KUBECONFIG (make test-cluster brings one up)")
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatalf("kubeconfig %s: %v", kubeconfig, err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	e := &env{
		t: t, cs: cs, kubeconfig: kubeconfig,
		echoImage: os.Getenv("TOPOLB_E2E_ECHO_IMAGE"),
		zoneOf:    map[string]string{}, nodeIP: map[string]string{},
	}
	if e.echoImage == "" {
		e.echoImage = "localhost/topolb-echo:dev"
	}
	e.kubectl = filepath.Join(os.Getenv("TOPOLB_KUBE_BINS"), "kubectl")
	if _, err := os.Stat(e.kubectl); err != nil {
		if e.kubectl, err = exec.LookPath("kubectl"); err != nil {
			t.Fatal("no kubectl in $TOPOLB_KUBE_BINS or on PATH")
		}
	}
	_, file, _, _ := runtime.Caller(0)
	e.topolbctl = filepath.Join(filepath.Dir(file), "..", "..", "bin", "topolbctl")
	if _, err := os.Stat(e.topolbctl); err != nil {
		t.Fatalf("%s: %v (make build)", e.topolbctl, err)
	}

	nodes, err := cs.CoreV1().Nodes().List(e.ctx(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, n := range nodes.Items {
		z := n.Labels[zoneLabel]
		if z == "" {
			t.Fatalf("node %s has no %s label", n.Name, zoneLabel)
		}
		e.zoneOf[n.Name] = z
		for _, a := range n.Status.Addresses {
			if a.Type == corev1.NodeInternalIP {
				e.nodeIP[n.Name] = a.Address
			}
		}
		if !seen[z] {
			seen[z] = true
			e.zones = append(e.zones, z)
		}
	}
	sort.Strings(e.zones)
	if len(e.zones) < 3 {
		t.Fatalf("want nodes in at least 3 zones, got %v", e.zoneOf)
	}

	e.ns = fmt.Sprintf("e2e-%s-%d", strings.ToLower(strings.ReplaceAll(t.Name(), "/", "-")), time.Now().Unix()%100000)
	if _, err := cs.CoreV1().Namespaces().Create(e.ctx(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: e.ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			e.dumpOnFailure()
		}
		err := cs.CoreV1().Namespaces().Delete(context.Background(), e.ns, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete namespace %s: %v", e.ns, err)
		}
	})
	return e
}

func (e *env) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	e.t.Cleanup(cancel)
	return ctx
}

// poll retries cond every second for up to timeout; cond's last error is
// reported.
func (e *env) poll(what string, timeout time.Duration, cond func() error) {
	e.t.Helper()
	var last error
	err := wait.PollUntilContextTimeout(context.Background(), time.Second, timeout, true, func(context.Context) (bool, error) {
		last = cond()
		return last == nil, nil
	})
	if err != nil {
		e.t.Fatalf("%s: not after %s: %v", what, timeout, last)
	}
}

// run runs a command and returns its stdout; stderr goes into the error.
func run(name string, args ...string) ([]byte, error) {
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(name, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.Bytes(), fmt.Errorf("%s %s: %w: %s", filepath.Base(name), strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.Bytes(), nil
}

func (e *env) kubectlRun(args ...string) ([]byte, error) {
	return run(e.kubectl, append([]string{"--kubeconfig", e.kubeconfig, "-n", e.ns}, args...)...)
}

// echoEnv gives the echo server its pod name, IP and node.
var echoEnv = []corev1.EnvVar{
	{Name: "POD_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.name"}}},
	{Name: "POD_IP", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "status.podIP"}}},
	{Name: "NODE_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "spec.nodeName"}}},
}

var smallRequests = corev1.ResourceRequirements{Requests: corev1.ResourceList{
	corev1.ResourceCPU: resource.MustParse("10m"), corev1.ResourceMemory: resource.MustParse("16Mi"),
}}

// deploy creates a Deployment of echo servers spread evenly over the zones,
// each ready once /readyz answers, draining 5 s after SIGTERM.
func (e *env) deploy(name string, replicas int32) {
	e.t.Helper()
	labels := map[string]string{"app": name}
	d := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To(replicas),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					TopologySpreadConstraints: []corev1.TopologySpreadConstraint{{
						MaxSkew: 1, TopologyKey: zoneLabel, WhenUnsatisfiable: corev1.DoNotSchedule,
						LabelSelector: &metav1.LabelSelector{MatchLabels: labels},
						// Spread each revision: a rolling update then ends
						// evenly spread, whatever the old pods' places.
						MatchLabelKeys: []string{appsv1.DefaultDeploymentUniqueLabelKey},
					}},
					TerminationGracePeriodSeconds: ptr.To[int64](30),
					Containers: []corev1.Container{{
						Name: "echo", Image: e.echoImage,
						Args:  []string{"serve", "-addr=:8080", "-drain=5s"},
						Env:   echoEnv,
						Ports: []corev1.ContainerPort{{ContainerPort: 8080}},
						ReadinessProbe: &corev1.Probe{
							ProbeHandler:  corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/readyz", Port: intstr.FromInt32(8080)}},
							PeriodSeconds: 1, FailureThreshold: 1,
						},
						Resources: smallRequests,
					}},
				},
			},
		},
	}
	if _, err := e.cs.AppsV1().Deployments(e.ns).Create(e.ctx(), d, metav1.CreateOptions{}); err != nil {
		e.t.Fatal(err)
	}
	e.waitRollout(name)
}

func (e *env) waitRollout(name string) {
	e.t.Helper()
	if _, err := e.kubectlRun("rollout", "status", "deploy/"+name, "--timeout=180s"); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) scale(name string, replicas int32) {
	e.t.Helper()
	if _, err := e.kubectlRun("scale", "deploy/"+name, fmt.Sprintf("--replicas=%d", replicas)); err != nil {
		e.t.Fatal(err)
	}
	e.waitRollout(name)
}

// service creates a ClusterIP Service on port 80 for the Deployment name.
func (e *env) service(name string, mutate func(*corev1.Service)) *corev1.Service {
	e.t.Helper()
	s := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": name},
			Ports:    []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080), Protocol: corev1.ProtocolTCP}},
		},
	}
	if mutate != nil {
		mutate(s)
	}
	s, err := e.cs.CoreV1().Services(e.ns).Create(e.ctx(), s, metav1.CreateOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	return s
}

// clients starts one client pod per zone and returns zone -> pod name.
func (e *env) clients() map[string]string {
	e.t.Helper()
	out := map[string]string{}
	for _, z := range e.zones {
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "client-" + z, Labels: map[string]string{"app": "client"}},
			Spec: corev1.PodSpec{
				NodeSelector:                  map[string]string{zoneLabel: z},
				TerminationGracePeriodSeconds: ptr.To[int64](1),
				Containers: []corev1.Container{{
					// The image has no shell: serve on localhost is its sleep.
					Name: "client", Image: e.echoImage, Args: []string{"serve", "-addr=127.0.0.1:8081", "-drain=0s"},
					Resources: smallRequests,
					// underLoad's stop file: the image's root is not
					// writable by its user.
					VolumeMounts: []corev1.VolumeMount{{Name: "tmp", MountPath: "/tmp"}},
				}},
				Volumes: []corev1.Volume{{Name: "tmp", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}}},
			},
		}
		if _, err := e.cs.CoreV1().Pods(e.ns).Create(e.ctx(), p, metav1.CreateOptions{}); err != nil {
			e.t.Fatal(err)
		}
		out[z] = p.Name
	}
	if _, err := e.kubectlRun("wait", "--for=condition=Ready", "pod", "-l", "app=client", "--timeout=120s"); err != nil {
		e.t.Fatal(err)
	}
	return out
}

// hostClient starts a host-network client pod in zone and returns its
// name.
func (e *env) hostClient(zone string) string {
	e.t.Helper()
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "host-client-" + zone},
		Spec: corev1.PodSpec{
			HostNetwork:                   true,
			NodeSelector:                  map[string]string{zoneLabel: zone},
			TerminationGracePeriodSeconds: ptr.To[int64](1),
			Containers: []corev1.Container{{
				// Its sleep listens on a loopback port no node uses.
				Name: "client", Image: e.echoImage, Args: []string{"serve", "-addr=127.0.0.1:18081", "-drain=0s"},
				Resources: smallRequests,
			}},
		},
	}
	if _, err := e.cs.CoreV1().Pods(e.ns).Create(e.ctx(), p, metav1.CreateOptions{}); err != nil {
		e.t.Fatal(err)
	}
	if _, err := e.kubectlRun("wait", "--for=condition=Ready", "pod/"+p.Name, "--timeout=120s"); err != nil {
		e.t.Fatal(err)
	}
	return p.Name
}

func (e *env) podNode(name string) string {
	e.t.Helper()
	p, err := e.cs.CoreV1().Pods(e.ns).Get(e.ctx(), name, metav1.GetOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	return p.Spec.NodeName
}

// result is what `echo get` prints.
type result = api.Result

// answeredBy makes 30 requests from pod to url and fails t when one fails
// or is answered from outside want (backends as ip:8080, what explain
// lists); it returns what answered.
func (e *env) answeredBy(t *testing.T, pod, url string, want []string) result {
	t.Helper()
	r, err := e.get(pod, url, "-n", "30")
	if err != nil {
		t.Fatal(err)
	}
	if r.Failed > 0 {
		t.Errorf("%s: %d of %d requests failed: %v", pod, r.Failed, r.Requests, r.Errors)
	}
	for ip, n := range r.ByIP {
		if !slices.Contains(want, net.JoinHostPort(ip, "8080")) {
			t.Errorf("%s: %d answers from %s, not a backend explain lists (%v)", pod, n, ip, want)
		}
	}
	return r
}

// get runs `echo get` in a client pod. A run with failed requests is
// returned with them counted, not as an error.
func (e *env) get(pod, url string, args ...string) (result, error) {
	out, err := e.kubectlRun(append([]string{"exec", pod, "--", "/echo", "get", "-url", url}, args...)...)
	var r result
	if jerr := json.Unmarshal(out, &r); jerr != nil {
		return r, fmt.Errorf("echo get in %s: %v (output %q)", pod, err, out)
	}
	return r, nil
}

// explained is one service port of `topolbctl explain -o json`.
type explained struct {
	Service  string   `json:"service"`
	Policy   string   `json:"policy"`
	Mode     string   `json:"mode"`
	Reason   string   `json:"reason"`
	Backends []string `json:"backends"`
}

// explain is `topolbctl explain` for one node and service of the test.
func (e *env) explain(node, svc string) explained {
	e.t.Helper()
	out, err := run(e.topolbctl, "explain", "--kubeconfig", e.kubeconfig, "--node", node, "--service", e.ns+"/"+svc, "-o", "json")
	if err != nil {
		e.t.Fatal(err)
	}
	var x struct {
		Services []explained `json:"services"`
	}
	if err := json.Unmarshal(out, &x); err != nil {
		e.t.Fatalf("topolbctl explain: %v\n%s", err, out)
	}
	if len(x.Services) != 1 {
		e.t.Fatalf("topolbctl explain --service %s/%s: want 1 service port, got %d\n%s", e.ns, svc, len(x.Services), out)
	}
	return x.Services[0]
}

// slices returns the ready endpoints of a Service: address -> endpoint.
func (e *env) readyEndpoints(svc string) (map[string]discoveryv1.Endpoint, error) {
	list, err := e.cs.DiscoveryV1().EndpointSlices(e.ns).List(e.ctx(), metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=" + svc})
	if err != nil {
		return nil, err
	}
	out := map[string]discoveryv1.Endpoint{}
	for _, s := range list.Items {
		for _, ep := range s.Endpoints {
			if ptr.Deref(ep.Conditions.Ready, false) && len(ep.Addresses) > 0 {
				out[ep.Addresses[0]] = ep
			}
		}
	}
	return out, nil
}

// dumpOnFailure logs what helps to see why: pods, slices, agent logs.
func (e *env) dumpOnFailure() {
	for _, args := range [][]string{
		{"get", "pods", "-o", "wide"},
		{"get", "endpointslices", "-o", "yaml"},
		{"-n", "topolb-system", "logs", "-l", "app.kubernetes.io/name=topolb-agent", "--tail=30", "--prefix"},
	} {
		out, err := e.kubectlRun(args...)
		e.t.Logf("kubectl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}
