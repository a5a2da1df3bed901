package testbed

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"path/filepath"
	"slices"
	"sync"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/topolb/topolb/kube"
)

// RelayAddress is where, inside every node's namespace, a relay forwards
// TCP connections to the apiserver in the host's namespace: a new network
// namespace cannot reach the host's 127.0.0.1.
const RelayAddress = "127.0.0.1:6443"

// kubeSync keeps an apiserver's objects equal to the testbed's.
type kubeSync struct {
	client kubernetes.Interface
	// services and slices the testbed created, to delete them when a
	// later Apply drops them.
	services map[types.NamespacedName]bool
	slices   map[types.NamespacedName]bool
	relays   []net.Listener
	wg       sync.WaitGroup
	kubecfg  map[string]string // node → kubeconfig path
}

// ConnectAPIServer makes the apiserver at cfg (for example a
// kubetest.Cluster's Config) the testbed's cluster: it creates the current
// objects there, keeps them in sync on every Apply, starts a relay to it in
// every node's namespace at RelayAddress, and writes one kubeconfig per
// node that agents started afterwards use instead of the manifest. The
// apiserver's certificate must be valid for 127.0.0.1.
func (tb *Testbed) ConnectAPIServer(ctx context.Context, cfg *rest.Config) (err error) {
	u, err := url.Parse(cfg.Host)
	if err != nil || u.Host == "" {
		return fmt.Errorf("apiserver URL %q: want https://host:port", cfg.Host)
	}
	// The testbed writes deprecated fields on purpose (externalIPs):
	// their warnings are noise here.
	quiet := rest.CopyConfig(cfg)
	quiet.WarningHandler = rest.NoWarnings{}
	client, err := kubernetes.NewForConfig(quiet)
	if err != nil {
		return fmt.Errorf("apiserver client: %w", err)
	}
	ks := &kubeSync{
		client:   client,
		services: map[types.NamespacedName]bool{},
		slices:   map[types.NamespacedName]bool{},
		kubecfg:  map[string]string{},
	}
	defer func() {
		if err != nil {
			ks.close()
		}
	}()
	for _, n := range tb.Nodes {
		l, err := n.NS.Listen("tcp4", RelayAddress)
		if err != nil {
			return fmt.Errorf("node %s: relay listener: %w", n.Name, err)
		}
		ks.relays = append(ks.relays, l)
		ks.wg.Add(1)
		go ks.relay(l, u.Host)
		path := filepath.Join(tb.Dir, "kubeconfig-"+n.Name)
		if err := writeKubeconfig(path, "https://"+RelayAddress, cfg); err != nil {
			return err
		}
		ks.kubecfg[n.Name] = path
	}
	tb.mu.Lock()
	defer tb.mu.Unlock()
	if tb.kube != nil {
		return errors.New("an apiserver is already connected")
	}
	if tb.svcs != nil {
		objs, err := tb.Objects(tb.svcs)
		if err != nil {
			return err
		}
		if err := ks.sync(ctx, objs); err != nil {
			return err
		}
		if tb.objs, err = kube.ListObjects(ctx, ks.client); err != nil {
			return err
		}
	}
	tb.kube = ks
	return nil
}

// KubeClient returns a client of the connected apiserver, nil without one.
func (tb *Testbed) KubeClient() kubernetes.Interface {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	if tb.kube == nil {
		return nil
	}
	return tb.kube.client
}

// kubeconfigFor returns the node's kubeconfig in apiserver mode, "" in
// standalone mode.
func (tb *Testbed) kubeconfigFor(node string) string {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	if tb.kube == nil {
		return ""
	}
	return tb.kube.kubecfg[node]
}

func writeKubeconfig(path, server string, cfg *rest.Config) error {
	kc := clientcmdapi.NewConfig()
	kc.Clusters["testbed"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: cfg.CAData, CertificateAuthority: cfg.CAFile}
	kc.AuthInfos["testbed"] = &clientcmdapi.AuthInfo{
		Token:                 cfg.BearerToken,
		ClientCertificateData: cfg.CertData,
		ClientKeyData:         cfg.KeyData,
	}
	kc.Contexts["testbed"] = &clientcmdapi.Context{Cluster: "testbed", AuthInfo: "testbed"}
	kc.CurrentContext = "testbed"
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		return fmt.Errorf("write kubeconfig: %w", err)
	}
	return nil
}

// relay copies connections accepted inside a node to target, dialled from
// the host's namespace.
func (ks *kubeSync) relay(l net.Listener, target string) {
	defer ks.wg.Done()
	for {
		in, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer in.Close()
			out, err := net.Dial("tcp", target)
			if err != nil {
				return
			}
			defer out.Close()
			done := make(chan struct{}, 2)
			go func() { io.Copy(out, in); out.(*net.TCPConn).CloseWrite(); done <- struct{}{} }()
			go func() { io.Copy(in, out); in.(*net.TCPConn).CloseWrite(); done <- struct{}{} }()
			<-done
			<-done
		}()
	}
}

func (ks *kubeSync) close() {
	for _, l := range ks.relays {
		l.Close()
	}
	ks.wg.Wait()
}

// sync creates or updates every object of objs in the apiserver and
// deletes the Services and EndpointSlices the testbed created earlier that
// objs no longer has. Nodes are only created or updated.
func (ks *kubeSync) sync(ctx context.Context, objs *kube.Objects) error {
	c := ks.client
	for _, n := range objs.Nodes {
		if err := syncNode(ctx, c, n); err != nil {
			return err
		}
	}
	namespaces := map[string]bool{}
	wantSvc := map[types.NamespacedName]bool{}
	for _, s := range objs.Services {
		if s.Namespace != v1.NamespaceDefault && !namespaces[s.Namespace] {
			_, err := c.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: s.Namespace}}, metav1.CreateOptions{})
			if err != nil && !apierrors.IsAlreadyExists(err) {
				return fmt.Errorf("create namespace %s: %w", s.Namespace, err)
			}
			namespaces[s.Namespace] = true
		}
		nn := types.NamespacedName{Namespace: s.Namespace, Name: s.Name}
		wantSvc[nn] = true
		if err := syncService(ctx, c, s); err != nil {
			return err
		}
		ks.services[nn] = true
	}
	wantSlice := map[types.NamespacedName]bool{}
	for _, es := range objs.Slices {
		nn := types.NamespacedName{Namespace: es.Namespace, Name: es.Name}
		wantSlice[nn] = true
		if err := syncSlice(ctx, c, es); err != nil {
			return err
		}
		ks.slices[nn] = true
	}
	for nn := range ks.slices {
		if !wantSlice[nn] {
			err := c.DiscoveryV1().EndpointSlices(nn.Namespace).Delete(ctx, nn.Name, metav1.DeleteOptions{})
			if err != nil && !apierrors.IsNotFound(err) {
				return fmt.Errorf("delete endpointslice %s: %w", nn, err)
			}
			delete(ks.slices, nn)
		}
	}
	for nn := range ks.services {
		if !wantSvc[nn] {
			err := c.CoreV1().Services(nn.Namespace).Delete(ctx, nn.Name, metav1.DeleteOptions{})
			if err != nil && !apierrors.IsNotFound(err) {
				return fmt.Errorf("delete service %s: %w", nn, err)
			}
			delete(ks.services, nn)
		}
	}
	return nil
}

func syncNode(ctx context.Context, c kubernetes.Interface, want *v1.Node) error {
	api := c.CoreV1().Nodes()
	cur, err := api.Get(ctx, want.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		cur, err = api.Create(ctx, want.DeepCopy(), metav1.CreateOptions{})
		if err != nil {
			return fmt.Errorf("create node %s: %w", want.Name, err)
		}
	case err != nil:
		return fmt.Errorf("get node %s: %w", want.Name, err)
	default:
		cur.Labels = want.Labels
		cur.Spec = want.Spec
		if cur, err = api.Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("update node %s: %w", want.Name, err)
		}
	}
	cur.Status = want.Status
	if _, err := api.UpdateStatus(ctx, cur, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("update node %s status: %w", want.Name, err)
	}
	return nil
}

// syncService creates or updates a Service, and writes its load-balancer
// ingress through the status subresource (the spec update ignores status),
// as a cloud controller would. A Service whose type or cluster IPs change
// is deleted and created again: the apiserver refuses most type changes in
// place (node ports, health check port and traffic policy must go with
// the type), and a change of the primary family.
func syncService(ctx context.Context, c kubernetes.Interface, want *v1.Service) error {
	api := c.CoreV1().Services(want.Namespace)
	name := want.Namespace + "/" + want.Name
	cur, err := api.Get(ctx, want.Name, metav1.GetOptions{})
	switch {
	case err == nil && (cur.Spec.Type != want.Spec.Type || !slices.Equal(cur.Spec.ClusterIPs, want.Spec.ClusterIPs)):
		if err := api.Delete(ctx, want.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete service %s to change its type or cluster IPs: %w", name, err)
		}
		fallthrough
	case apierrors.IsNotFound(err):
		if cur, err = api.Create(ctx, want.DeepCopy(), metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create service %s: %w", name, err)
		}
	case err != nil:
		return fmt.Errorf("get service %s: %w", name, err)
	default:
		cur.Annotations = want.Annotations
		cur.Labels = want.Labels
		// Keep the server's defaults (ipFamilies, ...) and set what the
		// testbed decides.
		cur.Spec.Ports = want.Spec.Ports
		cur.Spec.TrafficDistribution = want.Spec.TrafficDistribution
		cur.Spec.InternalTrafficPolicy = want.Spec.InternalTrafficPolicy
		if want.Spec.InternalTrafficPolicy == nil {
			p := v1.ServiceInternalTrafficPolicyCluster
			cur.Spec.InternalTrafficPolicy = &p
		}
		cur.Spec.ExternalIPs = want.Spec.ExternalIPs
		cur.Spec.ExternalTrafficPolicy = want.Spec.ExternalTrafficPolicy
		if cur.Spec.ExternalTrafficPolicy == "" && (cur.Spec.Type != v1.ServiceTypeClusterIP || len(cur.Spec.ExternalIPs) > 0) {
			cur.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyCluster
		}
		cur.Spec.HealthCheckNodePort = want.Spec.HealthCheckNodePort
		cur.Spec.SessionAffinity = want.Spec.SessionAffinity
		if cur.Spec.SessionAffinity == "" {
			cur.Spec.SessionAffinity = v1.ServiceAffinityNone
		}
		cur.Spec.SessionAffinityConfig = want.Spec.SessionAffinityConfig
		cur.Spec.LoadBalancerSourceRanges = want.Spec.LoadBalancerSourceRanges
		if cur, err = api.Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("update service %s: %w", name, err)
		}
	}
	if equality.Semantic.DeepEqual(cur.Status.LoadBalancer, want.Status.LoadBalancer) {
		return nil
	}
	cur.Status.LoadBalancer = want.Status.LoadBalancer
	if _, err := api.UpdateStatus(ctx, cur, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("update service %s status: %w", name, err)
	}
	return nil
}

func syncSlice(ctx context.Context, c kubernetes.Interface, want *discovery.EndpointSlice) error {
	api := c.DiscoveryV1().EndpointSlices(want.Namespace)
	cur, err := api.Get(ctx, want.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		if _, err := api.Create(ctx, want.DeepCopy(), metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create endpointslice %s/%s: %w", want.Namespace, want.Name, err)
		}
		return nil
	case err != nil:
		return fmt.Errorf("get endpointslice %s/%s: %w", want.Namespace, want.Name, err)
	}
	cur.Labels = want.Labels
	cur.Endpoints = want.Endpoints
	cur.Ports = want.Ports
	if _, err := api.Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("update endpointslice %s/%s: %w", want.Namespace, want.Name, err)
	}
	return nil
}
