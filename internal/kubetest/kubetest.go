// Package kubetest runs a real etcd and kube-apiserver for integration tests
// and demos, from the binaries tools/kube-bins.sh builds (`make kube-bins`).
//
// Only the apiserver runs: no controller manager, scheduler or kubelet. It
// stores and serves Services, EndpointSlices and the like exactly as a real
// cluster does, which is what topolb watches; anything a controller would
// fill in (EndpointSlices for a selector, namespace finalization, pods
// becoming ready) a test writes itself.
//
//	func TestSync(t *testing.T) {
//		c := kubetest.Start(t) // skips if `make kube-bins` has not run
//		_, err := c.Client.CoreV1().Services("default").Create(t.Context(), svc, metav1.CreateOptions{})
//		...
//		c.Stop()    // apiserver outage; etcd keeps the objects
//		c.Restart() // same URL, token and CA
//	}
package kubetest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// ServiceClusterIPRange is the apiserver's --service-cluster-ip-range: a
// Service's spec.clusterIP must be in it.
const ServiceClusterIPRange = "10.96.0.0/16"

// DualStackServiceClusterIPRange is the --service-cluster-ip-range
// WithDualStackServices gives the apiserver: ServiceClusterIPRange first
// (so Services that ask for nothing stay IPv4, as with the default), then
// an IPv6 range (a /108, the largest the apiserver allocates from).
const DualStackServiceClusterIPRange = ServiceClusterIPRange + ",fd00:10:96::/108"

const (
	startTimeout = 2 * time.Minute
	stopGrace    = 10 * time.Second
	startRetries = 3 // fresh ports after "address already in use"
)

// Option changes how Start and Run set up the cluster.
type Option func(*options)

type options struct {
	bind           netip.Addr
	apiserverFlags []string
	binDir         string
}

// WithBindAddress makes kube-apiserver listen on addr instead of 127.0.0.1,
// for example on a veth address that a network namespace can reach. The
// serving certificate covers addr; etcd stays on 127.0.0.1.
func WithBindAddress(addr netip.Addr) Option {
	return func(o *options) { o.bind = addr }
}

// WithAPIServerFlags appends flags, such as "--feature-gates=Foo=true", after
// the defaults. For a flag that takes one value the later one wins; list
// flags such as --disable-admission-plugins add to the defaults.
func WithAPIServerFlags(flags ...string) Option {
	return func(o *options) { o.apiserverFlags = append(o.apiserverFlags, flags...) }
}

// WithDualStackServices makes the apiserver allocate cluster IPs of both
// families (DualStackServiceClusterIPRange), so tests can create
// dual-stack and IPv6-only Services.
func WithDualStackServices() Option {
	return WithAPIServerFlags("--service-cluster-ip-range=" + DualStackServiceClusterIPRange)
}

// WithBinDir takes the binaries from dir instead of BinDir().
func WithBinDir(dir string) Option {
	return func(o *options) { o.binDir = dir }
}

func buildOptions(opts []Option) options {
	o := options{bind: netip.AddrFrom4([4]byte{127, 0, 0, 1})}
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

// Cluster is a running etcd and kube-apiserver. Its exported fields stay
// valid across Stop and Restart: the apiserver comes back on the same URL
// with the same certificate, token and etcd.
type Cluster struct {
	// Config authenticates with a bearer token as a member of
	// system:masters and verifies the apiserver's certificate. Copy it with
	// rest.CopyConfig before changing it.
	Config *rest.Config
	// Client is a clientset built from Config.
	Client kubernetes.Interface
	// KubeconfigPath is a kubeconfig file with the same server, CA and
	// token, for kubectl and kube-proxy (--kubeconfig).
	KubeconfigPath string
	// URL is the apiserver's https://address:port.
	URL string
	// Token is the admin bearer token.
	Token string
	// EtcdURL is etcd's client URL (http, no auth), for tests that look
	// beneath the apiserver.
	EtcdURL string
	// Dir holds the certificates, the etcd data and the logs
	// (etcd.log, kube-apiserver.log).
	Dir string

	binDir        string
	apiserverArgs []string
	httpClient    *http.Client // Config's transport, for /readyz
	ownsDir       bool         // Close removes Dir (Run); Start leaves it to t.TempDir

	mu        sync.Mutex
	etcd      *process
	apiserver *process // nil while stopped
	closed    bool
}

// Start runs a cluster for the test and stops it, with all its files, when
// the test ends. It skips the test if the binaries are missing (fails it
// instead when TOPOLB_KUBE_REQUIRED is set) and fails it if the cluster does
// not come up within two minutes.
func Start(t testing.TB, opts ...Option) *Cluster {
	t.Helper()
	o := buildOptions(opts)
	binDir, err := resolveBinDir(o)
	if err != nil {
		if os.Getenv(EnvRequired) != "" {
			t.Fatalf("kubetest: %v", err)
		}
		t.Skipf("kubetest: skipping: %v", err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), startTimeout)
	defer cancel()
	c, err := start(ctx, t.TempDir(), binDir, o)
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("kubetest: last lines of %s:\n%s", c.logPath("kube-apiserver"),
				tailFile(c.logPath("kube-apiserver"), 40))
		}
		if err := c.Close(); err != nil {
			t.Errorf("kubetest: %v", err)
		}
	})
	return c
}

// Run is Start for programs that are not tests, such as a demo: it returns
// an error wrapping ErrNoBinaries if the binaries are missing. ctx bounds
// start-up only; the cluster runs until Close, which also removes its files.
func Run(ctx context.Context, opts ...Option) (*Cluster, error) {
	o := buildOptions(opts)
	binDir, err := resolveBinDir(o)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "kubetest-")
	if err != nil {
		return nil, fmt.Errorf("create cluster dir: %w", err)
	}
	c, err := start(ctx, dir, binDir, o)
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	c.ownsDir = true
	return c, nil
}

func resolveBinDir(o options) (string, error) {
	dir := o.binDir
	if dir == "" {
		var err error
		if dir, err = BinDir(); err != nil {
			return "", fmt.Errorf("%w: %w", ErrNoBinaries, err)
		}
	}
	if err := checkBins(dir); err != nil {
		return "", err
	}
	return dir, nil
}

// start brings up etcd and then kube-apiserver with their files in dir.
func start(ctx context.Context, dir, binDir string, o options) (c *Cluster, err error) {
	c = &Cluster{Dir: dir, binDir: binDir}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()

	cr, err := writeCredentials(filepath.Join(dir, "certs"), o.bind)
	if err != nil {
		return nil, err
	}
	c.Token = cr.adminToken
	if err := c.startEtcd(ctx); err != nil {
		return nil, err
	}

	for attempt := 1; ; attempt++ {
		port, err := freePort(o.bind)
		if err != nil {
			return nil, err
		}
		if err := c.configure(o, cr, port); err != nil {
			return nil, err
		}
		err = c.startAPIServer(ctx)
		if err == nil {
			break
		}
		if attempt < startRetries && c.apiserver != nil && c.apiserver.addrInUse() {
			c.apiserver = nil
			continue
		}
		return nil, err
	}
	if err := c.writeKubeconfig(cr.caPEM); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *Cluster) logPath(component string) string {
	return filepath.Join(c.Dir, component+".log")
}

func (c *Cluster) startEtcd(ctx context.Context) error {
	lo := netip.AddrFrom4([4]byte{127, 0, 0, 1})
	for attempt := 1; ; attempt++ {
		clientPort, err := freePort(lo)
		if err != nil {
			return err
		}
		peerPort, err := freePort(lo)
		if err != nil {
			return err
		}
		clientURL := "http://" + netip.AddrPortFrom(lo, clientPort).String()
		peerURL := "http://" + netip.AddrPortFrom(lo, peerPort).String()
		args := []string{
			"--name=kubetest",
			"--data-dir=" + filepath.Join(c.Dir, "etcd"),
			"--listen-client-urls=" + clientURL,
			"--advertise-client-urls=" + clientURL,
			"--listen-peer-urls=" + peerURL,
			"--initial-advertise-peer-urls=" + peerURL,
			"--initial-cluster=kubetest=" + peerURL,
			"--unsafe-no-fsync", // throwaway data: durability only costs time
			"--log-level=warn",
		}
		p, err := startProcess("etcd", c.Bin("etcd"), args, c.logPath("etcd"))
		if err != nil {
			return err
		}
		c.etcd = p
		c.EtcdURL = clientURL
		err = waitReady(ctx, p, func(ctx context.Context) error {
			return probe(ctx, http.DefaultClient, clientURL+"/health", `"health":"true"`)
		})
		if err == nil {
			return nil
		}
		_ = p.stop(stopGrace)
		c.etcd = nil
		if attempt < startRetries && p.addrInUse() {
			continue
		}
		return err
	}
}

// configure sets the apiserver's flags and the client side for port.
func (c *Cluster) configure(o options, cr *credentials, port uint16) error {
	host := o.bind
	if host.IsUnspecified() {
		host = netip.AddrFrom4([4]byte{127, 0, 0, 1})
		if o.bind.Is6() {
			host = netip.IPv6Loopback()
		}
	}
	c.URL = "https://" + netip.AddrPortFrom(host, port).String()
	c.apiserverArgs = append([]string{
		"--etcd-servers=" + c.EtcdURL,
		"--bind-address=" + o.bind.String(),
		"--secure-port=" + strconv.Itoa(int(port)),
		"--advertise-address=" + host.String(),
		"--cert-dir=" + filepath.Dir(cr.certFile),
		"--tls-cert-file=" + cr.certFile,
		"--tls-private-key-file=" + cr.keyFile,
		"--token-auth-file=" + cr.tokenFile,
		"--authorization-mode=AlwaysAllow",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + cr.saPubFile,
		"--service-account-signing-key-file=" + cr.saKeyFile,
		"--service-cluster-ip-range=" + ServiceClusterIPRange,
		"--endpoint-reconciler-type=none",
		// No controller manager creates the default ServiceAccount.
		"--disable-admission-plugins=ServiceAccount",
		"--allow-privileged=true",
		"--profiling=false",
	}, o.apiserverFlags...)

	c.Config = &rest.Config{
		Host:            c.URL,
		BearerToken:     cr.adminToken,
		TLSClientConfig: rest.TLSClientConfig{CAData: cr.caPEM},
		QPS:             100,
		Burst:           200,
	}
	client, err := kubernetes.NewForConfig(c.Config)
	if err != nil {
		return fmt.Errorf("build clientset: %w", err)
	}
	c.Client = client
	if c.httpClient, err = rest.HTTPClientFor(c.Config); err != nil {
		return fmt.Errorf("build http client: %w", err)
	}
	return nil
}

// startAPIServer starts kube-apiserver with c.apiserverArgs and waits for
// /readyz, which includes the default ServiceCIDR that Service IP
// allocation needs.
func (c *Cluster) startAPIServer(ctx context.Context) error {
	p, err := startProcess("kube-apiserver", c.Bin("kube-apiserver"), c.apiserverArgs, c.logPath("kube-apiserver"))
	if err != nil {
		return err
	}
	c.apiserver = p
	err = waitReady(ctx, p, func(ctx context.Context) error {
		return probe(ctx, c.httpClient, c.URL+"/readyz", "ok")
	})
	if err != nil {
		_ = p.stop(stopGrace)
		return err
	}
	return nil
}

func (c *Cluster) writeKubeconfig(caPEM []byte) error {
	kc := clientcmdapi.NewConfig()
	kc.Clusters["kubetest"] = &clientcmdapi.Cluster{Server: c.URL, CertificateAuthorityData: caPEM}
	kc.AuthInfos["kubetest-admin"] = &clientcmdapi.AuthInfo{Token: c.Token}
	kc.Contexts["kubetest"] = &clientcmdapi.Context{Cluster: "kubetest", AuthInfo: "kubetest-admin", Namespace: "default"}
	kc.CurrentContext = "kubetest"
	path := filepath.Join(c.Dir, "kubeconfig")
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		return fmt.Errorf("write kubeconfig: %w", err)
	}
	c.KubeconfigPath = path
	return nil
}

// Bin returns the path of a binary built by tools/kube-bins.sh: "kubectl",
// "kube-proxy", "kube-apiserver" or "etcd". Only the last two are checked to
// exist.
func (c *Cluster) Bin(name string) string {
	return filepath.Join(c.binDir, name)
}

// Stop stops kube-apiserver and leaves etcd running, so a test can watch
// clients ride out an outage; Restart brings the apiserver back. Stopping a
// stopped apiserver does nothing. It returns an error only if the apiserver
// had died on its own.
func (c *Cluster) Stop() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.stopAPIServerLocked()
}

func (c *Cluster) stopAPIServerLocked() error {
	if c.apiserver == nil {
		return nil
	}
	err := c.apiserver.stop(stopGrace)
	c.apiserver = nil
	c.httpClient.CloseIdleConnections()
	return err
}

// Restart stops kube-apiserver if it is running and starts it again on the
// same address with the same flags, credentials and etcd, then waits until
// it is ready again (a few seconds).
func (c *Cluster) Restart() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return errors.New("kubetest: restart of a closed cluster")
	}
	stopErr := c.stopAPIServerLocked()
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	var err error
	// The port is fixed now; give a lingering socket a moment to go.
	for attempt := 1; ; attempt++ {
		err = c.startAPIServer(ctx)
		if err == nil || attempt == startRetries || !c.apiserver.addrInUse() {
			break
		}
		time.Sleep(time.Second)
	}
	if err != nil {
		c.apiserver = nil
		err = fmt.Errorf("restart kube-apiserver: %w", err)
	}
	return errors.Join(stopErr, err)
}

// Close stops kube-apiserver and etcd and, for a cluster from Run, removes
// its files. It is safe to call more than once.
func (c *Cluster) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	var errs []error
	if c.apiserver != nil {
		errs = append(errs, c.stopAPIServerLocked())
	}
	if c.etcd != nil {
		errs = append(errs, c.etcd.stop(stopGrace))
		c.etcd = nil
	}
	if c.ownsDir {
		errs = append(errs, os.RemoveAll(c.Dir))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("close cluster: %w", err)
	}
	return nil
}

// waitReady polls ready until it succeeds, the child exits or ctx ends.
func waitReady(ctx context.Context, p *process, ready func(context.Context) error) error {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	var last error
	for {
		if p.exited() {
			exit := p.err
			if exit == nil {
				exit = errors.New("exit status 0")
			}
			return fmt.Errorf("%s %w: %w\n%s", p.name, errExited, exit, p.logTail())
		}
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		last = ready(pctx)
		cancel()
		if last == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s not ready: %w (last probe: %w)\n%s", p.name, ctx.Err(), last, p.logTail())
		case <-p.done:
		case <-tick.C:
		}
	}
}

// probe GETs url and wants a 200 whose body contains want.
func probe(ctx context.Context, client *http.Client, url, want string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), want) {
		return fmt.Errorf("GET %s: %s: %.200s", url, resp.Status, body)
	}
	return nil
}
