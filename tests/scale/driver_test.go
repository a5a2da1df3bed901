package scale

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
)

// Shape of the simulated cluster.
const (
	zones          = 3
	imagesPerNode  = 20  // a kubelet reports up to 50; 20 is a modest node
	sliceMax       = 100 // the endpointslice controller's default maxEndpointsPerSlice
	writers        = 16  // concurrent creates while loading
	namespace      = "default"
	churnBatch     = 100 // Services in one rolling update wave (issue 33)
	triggerTimeAnn = "endpoints.kubernetes.io/last-change-trigger-time"
)

func zoneOf(i int) string { return fmt.Sprintf("zone-%c", 'a'+i%zones) }

func nodeName(i int) string { return fmt.Sprintf("node-%d", i) }

// nodeAddr is node i's InternalIP: 10.0.0.0/16 from 10.0.0.1.
func nodeAddr(i int) string {
	return netip.AddrFrom4([4]byte{10, 0, byte((i + 1) >> 8), byte(i + 1)}).String()
}

// newNode is a Node as a kubelet registers it: the well-known labels,
// capacity and allocatable, addresses, node info, five conditions and
// images (about 5 KB in JSON, as small clusters' nodes; busy ones carry
// more images).
func newNode(i int) *v1.Node {
	res := v1.ResourceList{
		v1.ResourceCPU:              resource.MustParse("8"),
		v1.ResourceMemory:           resource.MustParse("32Gi"),
		v1.ResourcePods:             resource.MustParse("110"),
		v1.ResourceEphemeralStorage: resource.MustParse("100Gi"),
	}
	n := &v1.Node{
		ObjectMeta: metav1.ObjectMeta{
			Name: nodeName(i),
			Labels: map[string]string{
				"kubernetes.io/hostname":           nodeName(i),
				"kubernetes.io/os":                 "linux",
				"kubernetes.io/arch":               "amd64",
				"beta.kubernetes.io/os":            "linux",
				"beta.kubernetes.io/arch":          "amd64",
				"topology.kubernetes.io/zone":      zoneOf(i),
				"topology.kubernetes.io/region":    "region-1",
				"node.kubernetes.io/instance-type": "standard-8",
				"node-pool":                        fmt.Sprintf("pool-%d", i%4),
			},
			Annotations: map[string]string{
				"node.alpha.kubernetes.io/ttl":                           "0",
				"volumes.kubernetes.io/controller-managed-attach-detach": "true",
			},
		},
		Spec: v1.NodeSpec{PodCIDR: fmt.Sprintf("10.%d.%d.0/24", 128+i>>8, i&0xff)},
		Status: v1.NodeStatus{
			Capacity:    res,
			Allocatable: res,
			Addresses: []v1.NodeAddress{
				{Type: v1.NodeInternalIP, Address: nodeAddr(i)},
				{Type: v1.NodeHostName, Address: nodeName(i)},
			},
			NodeInfo: v1.NodeSystemInfo{
				MachineID: fmt.Sprintf("%032x", i), SystemUUID: fmt.Sprintf("%032x", i), BootID: fmt.Sprintf("%032x", i),
				KernelVersion: "6.12.0", OSImage: "Debian GNU/Linux 13", ContainerRuntimeVersion: "containerd://2.4.2",
				KubeletVersion: "v1.37.2", OperatingSystem: "linux", Architecture: "amd64",
			},
			Conditions: conditions(time.Now()),
		},
	}
	for j := range imagesPerNode {
		n.Status.Images = append(n.Status.Images, v1.ContainerImage{
			Names: []string{
				fmt.Sprintf("registry.example.com/team-%d/app-%d@sha256:%064x", j%5, j, j),
				fmt.Sprintf("registry.example.com/team-%d/app-%d:v1.%d.0", j%5, j, j),
			},
			SizeBytes: int64(50+j) << 20,
		})
	}
	return n
}

// conditions are a healthy kubelet's, heartbeat at now.
func conditions(now time.Time) []v1.NodeCondition {
	t := metav1.NewTime(now)
	c := func(typ v1.NodeConditionType, st v1.ConditionStatus, reason string) v1.NodeCondition {
		return v1.NodeCondition{Type: typ, Status: st, LastHeartbeatTime: t, LastTransitionTime: t, Reason: reason, Message: "kubelet " + reason}
	}
	return []v1.NodeCondition{
		c(v1.NodeMemoryPressure, v1.ConditionFalse, "KubeletHasSufficientMemory"),
		c(v1.NodeDiskPressure, v1.ConditionFalse, "KubeletHasNoDiskPressure"),
		c(v1.NodePIDPressure, v1.ConditionFalse, "KubeletHasSufficientPID"),
		c(v1.NodeReady, v1.ConditionTrue, "KubeletReady"),
	}
}

// svcName is Service i's name; its EndpointSlice is svcName(i)+"-1".
func svcName(i int) string { return fmt.Sprintf("svc-%d", i) }

// newService is a ClusterIP Service with one port that prefers its
// clients' zone (trafficDistribution), as topology-aware Services do.
func newService(i int) *v1.Service {
	return &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: svcName(i), Namespace: namespace, Labels: map[string]string{"app": svcName(i)}},
		Spec: v1.ServiceSpec{
			Selector:            map[string]string{"app": svcName(i)},
			Ports:               []v1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080), Protocol: v1.ProtocolTCP}},
			TrafficDistribution: ptr.To(v1.ServiceTrafficDistributionPreferSameZone),
		},
	}
}

// podAddr is a pod address: generation g of endpoint e of Service i, all
// distinct in 10.128.0.0/9 for up to 2^23 of them.
func podAddr(seq uint32) string {
	seq &= 1<<23 - 1
	return netip.AddrFrom4([4]byte{10, 128 | byte(seq>>16), byte(seq >> 8), byte(seq)}).String()
}

// newSlice is Service i's one EndpointSlice of eps endpoints (at most
// sliceMax), endpoint e on node (i+e) mod nodes with its zone's hint;
// gen picks fresh pod addresses after a rollout step.
func newSlice(i, eps, nodes int, addrs []uint32) *discovery.EndpointSlice {
	s := &discovery.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Name: svcName(i) + "-1", Namespace: namespace,
			Labels: map[string]string{
				discovery.LabelServiceName: svcName(i),
				discovery.LabelManagedBy:   "endpointslice-controller.k8s.io",
			},
			Annotations: map[string]string{triggerTimeAnn: time.Now().UTC().Format(time.RFC3339Nano)},
		},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: ptr.To(v1.ProtocolTCP)}},
	}
	for e := range eps {
		node := (i + e) % nodes
		s.Endpoints = append(s.Endpoints, discovery.Endpoint{
			Addresses:  []string{podAddr(addrs[e])},
			Conditions: discovery.EndpointConditions{Ready: ptr.To(true), Serving: ptr.To(true), Terminating: ptr.To(false)},
			NodeName:   ptr.To(nodeName(node)),
			Zone:       ptr.To(zoneOf(node)),
			Hints:      &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: zoneOf(node)}}},
			TargetRef:  &v1.ObjectReference{Kind: "Pod", Namespace: namespace, Name: fmt.Sprintf("%s-%d", svcName(i), addrs[e])},
		})
	}
	return s
}

// driver is the cluster's kubelets and endpointslice controller: it
// creates the Nodes, Services and slices, then posts Node statuses and
// rolls Services' endpoints.
type driver struct {
	client   kubernetes.Interface
	nodes    int
	services int
	eps      int // endpoints per Service

	mu       sync.Mutex
	addrs    [][]uint32 // per Service, its endpoints' address sequence numbers
	nextAddr uint32

	statusWrites atomic.Int64 // Node status patches made
	sliceWrites  atomic.Int64 // EndpointSlice updates made
	errors       atomic.Int64 // writes that failed
	lastErr      atomic.Value
}

// parallel runs fn(0..n-1) on writers goroutines and returns the first
// error.
func parallel(ctx context.Context, n int, fn func(ctx context.Context, i int) error) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	next := atomic.Int64{}
	var wg sync.WaitGroup
	for range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= n || ctx.Err() != nil {
					return
				}
				if err := fn(ctx, i); err != nil {
					cancel(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if err := context.Cause(ctx); err != nil && err != context.Canceled {
		return err
	}
	return nil
}

// load creates every Node, Service and EndpointSlice.
func (d *driver) load(ctx context.Context) error {
	err := parallel(ctx, d.nodes, func(ctx context.Context, i int) error {
		n := newNode(i)
		created, err := d.client.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{})
		if err != nil {
			return fmt.Errorf("create node %d: %w", i, err)
		}
		// Status is a subresource: Create drops it.
		created.Status = n.Status
		if _, err := d.client.CoreV1().Nodes().UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("post status of node %d: %w", i, err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	d.addrs = make([][]uint32, d.services)
	for i := range d.addrs {
		for range d.eps {
			d.addrs[i] = append(d.addrs[i], d.nextAddr)
			d.nextAddr++
		}
	}
	return parallel(ctx, d.services, func(ctx context.Context, i int) error {
		if _, err := d.client.CoreV1().Services(namespace).Create(ctx, newService(i), metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create service %d: %w", i, err)
		}
		if _, err := d.client.DiscoveryV1().EndpointSlices(namespace).Create(ctx, newSlice(i, d.eps, d.nodes, d.addrs[i]), metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create endpointslice %d: %w", i, err)
		}
		return nil
	})
}

func (d *driver) failed(err error) {
	d.errors.Add(1)
	d.lastErr.Store(err.Error())
}

// heartbeats patches every Node's status once per period, spread evenly,
// until ctx is done: the kubelet's status report with fresh heartbeat
// times (a strategic merge patch of the conditions, as the kubelet's).
func (d *driver) heartbeats(ctx context.Context, period time.Duration) {
	tick := time.NewTicker(period / time.Duration(d.nodes))
	defer tick.Stop()
	work := make(chan int, writers)
	var wg sync.WaitGroup
	for range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				patch, err := json.Marshal(map[string]any{"status": map[string]any{"conditions": conditions(time.Now())}})
				if err == nil {
					_, err = d.client.CoreV1().Nodes().PatchStatus(ctx, nodeName(i), patch)
				}
				if err != nil && ctx.Err() == nil {
					d.failed(err)
					continue
				}
				d.statusWrites.Add(1)
			}
		}()
	}
	defer wg.Wait()
	defer close(work)
	for i := 0; ; i = (i + 1) % d.nodes {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		select {
		case work <- i:
		default: // the writers are behind: the achieved rate says so
		}
	}
}

// rollouts replaces endpoints at perSecond slice updates a second until
// ctx is done: a rolling update of churnBatch Services at a time, each
// step replacing one pod of each Service in the wave (a new address),
// until every pod of the wave is new; then the next wave.
func (d *driver) rollouts(ctx context.Context, perSecond int) {
	tick := time.NewTicker(time.Second / time.Duration(perSecond))
	defer tick.Stop()
	wave, step, k := 0, 0, 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		i := (wave*churnBatch + k) % d.services
		d.mu.Lock()
		d.addrs[i][step%d.eps] = d.nextAddr
		d.nextAddr++
		s := newSlice(i, d.eps, d.nodes, d.addrs[i])
		d.mu.Unlock()
		if _, err := d.client.DiscoveryV1().EndpointSlices(namespace).Update(ctx, s, metav1.UpdateOptions{}); err != nil {
			if ctx.Err() == nil {
				d.failed(err)
			}
		} else {
			d.sliceWrites.Add(1)
		}
		if k++; k == min(churnBatch, d.services) {
			k = 0
			if step++; step == d.eps {
				step = 0
				wave++
			}
		}
	}
}
