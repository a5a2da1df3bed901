package kubetest_test

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/topolb/topolb/internal/kubetest"
)

const (
	testNS      = "topolb-kubetest"
	testSvc     = "web"
	testSvcIP   = "10.96.10.10"
	managedBy   = "topolb-tests"
	sliceSuffix = "-abc12"
)

func testService() *corev1.Service {
	return &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: testSvc, Namespace: testNS},
		Spec: corev1.ServiceSpec{
			Type:       corev1.ServiceTypeClusterIP,
			ClusterIP:  testSvcIP,
			IPFamilies: []corev1.IPFamily{corev1.IPv4Protocol},
			Ports: []corev1.ServicePort{{
				Name: "http", Protocol: corev1.ProtocolTCP, Port: 80, TargetPort: intstr.FromInt32(8080),
			}},
		},
	}
}

func testSlice() *discoveryv1.EndpointSlice {
	ready := true
	notReady := false
	zoneA, zoneB := "zone-a", "zone-b"
	port, name, proto := int32(8080), "http", corev1.ProtocolTCP
	return &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Name:      testSvc + sliceSuffix,
			Namespace: testNS,
			Labels: map[string]string{
				discoveryv1.LabelServiceName: testSvc,
				discoveryv1.LabelManagedBy:   managedBy,
			},
		},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints: []discoveryv1.Endpoint{
			{
				Addresses:  []string{"10.244.1.5"},
				Conditions: discoveryv1.EndpointConditions{Ready: &ready},
				Zone:       &zoneA,
				Hints:      &discoveryv1.EndpointHints{ForZones: []discoveryv1.ForZone{{Name: zoneA}}},
			},
			{
				Addresses:  []string{"10.244.2.7"},
				Conditions: discoveryv1.EndpointConditions{Ready: &notReady},
				Zone:       &zoneB,
			},
		},
		Ports: []discoveryv1.EndpointPort{{Name: &name, Port: &port, Protocol: &proto}},
	}
}

// TestCluster writes a Service and its EndpointSlice through the real
// apiserver, reads them back through client-go and kubectl, and checks that
// they survive an apiserver restart on the same etcd.
func TestCluster(t *testing.T) {
	t0 := time.Now()
	c := kubetest.Start(t)
	t.Logf("cluster ready in %v at %s", time.Since(t0).Round(time.Millisecond), c.URL)
	ctx := t.Context()

	v, err := c.Client.Discovery().ServerVersion()
	if err != nil {
		t.Fatalf("server version: %v", err)
	}
	if v.Major != "1" || !strings.HasPrefix(v.GitVersion, "v1.") {
		t.Errorf("server version = %q (major %q), want a v1.x release stamped by kube-bins.sh", v.GitVersion, v.Major)
	}

	if _, err := c.Client.CoreV1().Namespaces().Create(ctx,
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNS}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create namespace: %v", err)
	}
	if _, err := c.Client.CoreV1().Services(testNS).Create(ctx, testService(), metav1.CreateOptions{}); err != nil {
		t.Fatalf("create service: %v", err)
	}
	wantSlice := testSlice()
	if _, err := c.Client.DiscoveryV1().EndpointSlices(testNS).Create(ctx, wantSlice, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create endpointslice: %v", err)
	}

	svc := checkReadBack(t, c, wantSlice)

	// A second Service asking for the same cluster IP must be refused: the
	// apiserver's allocator is real.
	dup := testService()
	dup.Name = "web-dup"
	if _, err := c.Client.CoreV1().Services(testNS).Create(ctx, dup, metav1.CreateOptions{}); !apierrors.IsInvalid(err) {
		t.Errorf("create service with taken clusterIP: err = %v, want Invalid", err)
	}

	// kubectl, through the kubeconfig file.
	out, err := exec.CommandContext(ctx, c.Bin("kubectl"), "--kubeconfig", c.KubeconfigPath,
		"-n", testNS, "get", "svc", "-o", "json").Output()
	if err != nil {
		t.Fatalf("kubectl get svc: %v\n%s", err, stderrOf(err))
	}
	var list corev1.ServiceList
	if err := json.Unmarshal(out, &list); err != nil {
		t.Fatalf("decode kubectl output: %v\n%s", err, out)
	}
	if len(list.Items) != 1 || list.Items[0].Name != testSvc || list.Items[0].Spec.ClusterIP != testSvcIP ||
		list.Items[0].UID != svc.UID {
		t.Errorf("kubectl get svc = %+v, want only %s/%s with clusterIP %s and uid %s",
			list.Items, testNS, testSvc, testSvcIP, svc.UID)
	}

	out, err = exec.CommandContext(ctx, c.Bin("kube-proxy"), "--version").Output()
	if err != nil || !strings.HasPrefix(string(out), "Kubernetes v1.") {
		t.Errorf("kube-proxy --version = %q, %v; want Kubernetes v1.x", out, err)
	}

	// Outage: with the apiserver stopped requests fail; after Restart the
	// same URL, token and CA work and etcd still has the objects.
	t0 = time.Now()
	if err := c.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	t.Logf("apiserver stopped in %v", time.Since(t0).Round(time.Millisecond))
	down, cancel := context.WithTimeout(ctx, 5*time.Second)
	_, err = c.Client.CoreV1().Services(testNS).Get(down, testSvc, metav1.GetOptions{})
	cancel()
	if err == nil {
		t.Fatal("get service with the apiserver stopped: no error")
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("get service with the apiserver stopped: %v, want connection refused", err)
	}
	t0 = time.Now()
	if err := c.Restart(); err != nil {
		t.Fatalf("restart: %v", err)
	}
	t.Logf("apiserver ready again in %v", time.Since(t0).Round(time.Millisecond))
	after := checkReadBack(t, c, wantSlice)
	if after.ResourceVersion != svc.ResourceVersion {
		t.Errorf("service resourceVersion after restart = %s, want %s (unchanged in etcd)",
			after.ResourceVersion, svc.ResourceVersion)
	}
	// And it takes writes again.
	after.Labels = map[string]string{"restarted": "yes"}
	if _, err := c.Client.CoreV1().Services(testNS).Update(ctx, after, metav1.UpdateOptions{}); err != nil {
		t.Errorf("update service after restart: %v", err)
	}
}

// checkReadBack reads the test Service and EndpointSlice back and compares
// them with what was written; it returns the Service.
func checkReadBack(t *testing.T, c *kubetest.Cluster, wantSlice *discoveryv1.EndpointSlice) *corev1.Service {
	t.Helper()
	ctx := t.Context()
	svc, err := c.Client.CoreV1().Services(testNS).Get(ctx, testSvc, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get service: %v", err)
	}
	want := testService().Spec
	if svc.Spec.ClusterIP != want.ClusterIP || !reflect.DeepEqual(svc.Spec.ClusterIPs, []string{want.ClusterIP}) {
		t.Errorf("service clusterIP = %s %v, want %s", svc.Spec.ClusterIP, svc.Spec.ClusterIPs, want.ClusterIP)
	}
	if !reflect.DeepEqual(svc.Spec.Ports, want.Ports) {
		t.Errorf("service ports = %+v, want %+v", svc.Spec.Ports, want.Ports)
	}
	if !reflect.DeepEqual(svc.Spec.IPFamilies, want.IPFamilies) {
		t.Errorf("service ipFamilies = %v, want %v", svc.Spec.IPFamilies, want.IPFamilies)
	}

	slices, err := c.Client.DiscoveryV1().EndpointSlices(testNS).List(ctx, metav1.ListOptions{
		LabelSelector: discoveryv1.LabelServiceName + "=" + testSvc + "," + discoveryv1.LabelManagedBy + "=" + managedBy,
	})
	if err != nil {
		t.Fatalf("list endpointslices: %v", err)
	}
	if len(slices.Items) != 1 {
		t.Fatalf("endpointslices for %s = %d, want 1", testSvc, len(slices.Items))
	}
	got := slices.Items[0]
	if got.Name != wantSlice.Name || got.AddressType != wantSlice.AddressType ||
		!reflect.DeepEqual(got.Endpoints, wantSlice.Endpoints) || !reflect.DeepEqual(got.Ports, wantSlice.Ports) {
		t.Errorf("endpointslice = %+v, want %+v", got, wantSlice)
	}
	return svc
}

// TestRunClose covers the t-less entry point, a non-default bind address and
// extra apiserver flags, and checks that Close stops everything and removes
// the files.
func TestRunClose(t *testing.T) {
	ctx := t.Context()
	bind := netip.MustParseAddr("127.0.0.2") // all of 127/8 is on lo
	c, err := kubetest.Run(ctx, kubetest.WithBindAddress(bind),
		kubetest.WithAPIServerFlags("--disable-admission-plugins=NamespaceLifecycle"))
	if errors.Is(err, kubetest.ErrNoBinaries) && os.Getenv(kubetest.EnvRequired) == "" {
		t.Skipf("kubetest: %v", err)
	}
	if err != nil {
		t.Fatalf("run: %v", err)
	}
	defer c.Close()

	if want := "https://" + bind.String() + ":"; !strings.HasPrefix(c.URL, want) {
		t.Errorf("URL = %s, want prefix %s", c.URL, want)
	}
	// With NamespaceLifecycle disabled by the extra flag, a Service in a
	// namespace that does not exist is accepted.
	svc := testService()
	svc.Namespace = "no-such-namespace"
	if _, err := c.Client.CoreV1().Services(svc.Namespace).Create(ctx, svc, metav1.CreateOptions{}); err != nil {
		t.Errorf("create service in a missing namespace with NamespaceLifecycle disabled: %v", err)
	}

	if err := c.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	if _, err := os.Stat(c.Dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("cluster dir %s after Close: %v, want it removed", c.Dir, err)
	}
	conn, err := net.DialTimeout("tcp", strings.TrimPrefix(c.URL, "https://"), time.Second)
	if err == nil {
		conn.Close()
		t.Errorf("apiserver at %s still accepts connections after Close", c.URL)
	}
	if conn, err := net.DialTimeout("tcp", strings.TrimPrefix(c.EtcdURL, "http://"), time.Second); err == nil {
		conn.Close()
		t.Errorf("etcd at %s still accepts connections after Close", c.EtcdURL)
	}
	if err := c.Close(); err != nil {
		t.Errorf("second close: %v", err)
	}
}

func TestRunWithoutBinaries(t *testing.T) {
	_, err := kubetest.Run(t.Context(), kubetest.WithBinDir(t.TempDir()))
	if !errors.Is(err, kubetest.ErrNoBinaries) {
		t.Fatalf("run with an empty bin dir: err = %v, want ErrNoBinaries", err)
	}
}

func stderrOf(err error) []byte {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.Stderr
	}
	return nil
}
