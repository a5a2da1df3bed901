package kube

import (
	"context"
	"errors"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/topolb/topolb/topology"
)

// NodeWatch says which Nodes an agent watches.
type NodeWatch string

const (
	// NodeWatchOwn watches this node's Node only (a metadata.name field
	// selector, as kube-proxy), and reads what decisions need of the
	// others from the topology summary (SummaryName).
	NodeWatchOwn NodeWatch = "own"
	// NodeWatchAll watches every Node.
	NodeWatchAll NodeWatch = "all"
)

// ParseNodeWatch parses --node-watch.
func ParseNodeWatch(s string) (NodeWatch, error) {
	switch w := NodeWatch(s); w {
	case NodeWatchOwn, NodeWatchAll:
		return w, nil
	}
	return "", fmt.Errorf("--node-watch %q: want %s or %s", s, NodeWatchOwn, NodeWatchAll)
}

// WatchOptions say what Watch watches beyond Services and EndpointSlices.
type WatchOptions struct {
	// Nodes is which Nodes to watch; "" is NodeWatchAll.
	Nodes NodeWatch
	// NodeName is this node, the one Node NodeWatchOwn watches.
	NodeName string
	// SummaryNamespace is where NodeWatchOwn reads the topology summary.
	SummaryNamespace string
}

// Watch starts shared informers for Services, EndpointSlices and Nodes
// (all of them, or this node's only with the topology summary, opts.Nodes)
// that feed t, waits until t has received their initial lists, then asks t
// for a full resync.
// The informers stop when ctx is done.
//
// Like kube-proxy, it does not watch the Services it never proxies, nor
// their EndpointSlices: the Service watch selects neither a
// service.kubernetes.io/service-proxy-name label nor clusterIP None, the
// EndpointSlice watch no service.kubernetes.io/headless label (the
// endpointslice controller's mark on a headless Service's slices). A
// Service that gains the label, so, is deleted from t. The decision engine
// skips the same Services (topology.SkipReason) for manifests and explain.
func Watch(ctx context.Context, c kubernetes.Interface, t *Tracker, opts WatchOptions) error {
	own := opts.Nodes == NodeWatchOwn
	if own && (opts.NodeName == "" || opts.SummaryNamespace == "") {
		return errors.New("watch own node: node name and summary namespace are required")
	}
	sf := informers.NewSharedInformerFactoryWithOptions(c, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.LabelSelector, o.FieldSelector = ServiceSelectors()
	}))
	ef := informers.NewSharedInformerFactoryWithOptions(c, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.LabelSelector = SliceSelector()
	}))
	nf := informers.NewSharedInformerFactory(c, 0)
	if own {
		nf = informers.NewSharedInformerFactoryWithOptions(c, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", opts.NodeName).String()
		}))
	}
	factories := []informers.SharedInformerFactory{sf, ef, nf}
	svc := sf.Core().V1().Services().Informer()
	es := ef.Discovery().V1().EndpointSlices().Informer()
	nodes := nf.Core().V1().Nodes().Informer()
	informed := []cache.SharedIndexInformer{svc, es, nodes}
	var summary cache.SharedIndexInformer
	if own {
		cf := SummaryInformerFactory(c, opts.SummaryNamespace)
		factories = append(factories, cf)
		summary = cf.Core().V1().ConfigMaps().Informer()
		informed = append(informed, summary)
	}
	// Keep only what decisions read, so 100,000 endpoints' managedFields
	// and node statuses do not stay in memory.
	for _, inf := range informed {
		if err := inf.SetTransform(trim); err != nil {
			return fmt.Errorf("set informer transform: %w", err)
		}
	}
	svcReg, err := svc.AddEventHandler(handler(t.ServiceChanged))
	if err != nil {
		return fmt.Errorf("watch services: %w", err)
	}
	esReg, err := es.AddEventHandler(handler(t.SliceChanged))
	if err != nil {
		return fmt.Errorf("watch endpointslices: %w", err)
	}
	nodeReg, err := nodes.AddEventHandler(handler(t.NodeChanged))
	if err != nil {
		return fmt.Errorf("watch nodes: %w", err)
	}
	regs := []cache.InformerSynced{svcReg.HasSynced, esReg.HasSynced, nodeReg.HasSynced}
	if summary != nil {
		sumReg, err := summary.AddEventHandler(handler(t.SummaryChanged))
		if err != nil {
			return fmt.Errorf("watch topology summary: %w", err)
		}
		regs = append(regs, sumReg.HasSynced)
		go checkSummaryAge(ctx, t)
	}
	for _, f := range factories {
		f.Start(ctx.Done())
	}
	for _, f := range factories {
		for typ, ok := range f.WaitForCacheSync(ctx.Done()) {
			if !ok {
				return fmt.Errorf("informer cache for %v did not sync: %w", typ, ctx.Err())
			}
		}
	}
	// A synced cache is not a delivered one: the handlers receive the
	// initial lists after the caches hold them. The resync must follow
	// every initial object into t, or the first full sync would decide a
	// Service without its EndpointSlices.
	if !cache.WaitForCacheSync(ctx.Done(), regs...) {
		return fmt.Errorf("informer handlers did not receive the initial lists: %w", ctx.Err())
	}
	t.Resync()
	return nil
}

// checkSummaryAge has t note when the summary grows older than
// SummaryStaleAfter, until ctx is done.
func checkSummaryAge(ctx context.Context, t *Tracker) {
	tick := time.NewTicker(SummaryStaleAfter / 30)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-tick.C:
			t.CheckSummaryAge(now, SummaryStaleAfter)
		}
	}
}

// ServiceSelectors are the label and field selectors of the Service watch,
// kube-proxy's: no service-proxy-name label, not headless.
func ServiceSelectors() (label, field string) {
	return "!" + topology.LabelServiceProxyName, fields.OneTermNotEqualSelector("spec.clusterIP", v1.ClusterIPNone).String()
}

// SliceSelector is the label selector of the EndpointSlice watch,
// kube-proxy's: not a headless Service's.
func SliceSelector() string { return "!" + v1.IsHeadlessService }

// trim drops the parts of objects topolb never reads. What it keeps must
// cover everything the decision engine's model reads of them
// (topology.NodeFromObject, topology.ServicePorts, topology.EndpointsForPort,
// topology.ServiceHealthCheck): TestTrimKeepsTheModel checks that the model
// built from a trimmed object equals the one built from the whole object.
func trim(obj any) (any, error) {
	switch o := obj.(type) {
	case *v1.Node:
		return trimNode(o), nil
	case *v1.Service:
		meta := trimMeta(o.ObjectMeta, false)
		// The watch never delivers it, but the model reads it.
		if name, ok := o.Labels[topology.LabelServiceProxyName]; ok {
			meta.Labels = map[string]string{topology.LabelServiceProxyName: name}
		}
		o.ObjectMeta = meta
		return o, nil
	case *discovery.EndpointSlice:
		o.ObjectMeta = trimMeta(o.ObjectMeta, true)
		return o, nil
	case *v1.ConfigMap:
		o.ObjectMeta = trimMeta(o.ObjectMeta, false)
		return o, nil
	}
	return obj, nil
}

// trimNode keeps a Node's labels, its deletion timestamp and the cluster
// autoscaler's taint and, of its status, the allocatable CPU, the Ready
// condition's status (not its heartbeat times) and the addresses.
func trimNode(o *v1.Node) *v1.Node {
	n := &v1.Node{TypeMeta: o.TypeMeta, ObjectMeta: trimMeta(o.ObjectMeta, true)}
	n.DeletionTimestamp = o.DeletionTimestamp
	for _, t := range o.Spec.Taints {
		if t.Key == topology.ToBeDeletedTaint {
			n.Spec.Taints = []v1.Taint{t}
			break
		}
	}
	if cpu, ok := o.Status.Allocatable[v1.ResourceCPU]; ok {
		n.Status.Allocatable = v1.ResourceList{v1.ResourceCPU: cpu}
	}
	for _, c := range o.Status.Conditions {
		if c.Type == v1.NodeReady {
			n.Status.Conditions = []v1.NodeCondition{{Type: c.Type, Status: c.Status}}
		}
	}
	n.Status.Addresses = o.Status.Addresses
	return n
}

func trimMeta(m metaObject, keepLabels bool) metaObject {
	out := metaObject{Name: m.Name, Namespace: m.Namespace, ResourceVersion: m.ResourceVersion, UID: m.UID,
		CreationTimestamp: m.CreationTimestamp, Annotations: topolbAnnotations(m.Annotations)}
	if keepLabels {
		out.Labels = m.Labels
	}
	return out
}

// handler adapts a tracker method to informer callbacks.
func handler[T any](changed func(prev, cur *T)) cache.ResourceEventHandlerFuncs {
	as := func(obj any) *T {
		if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = d.Obj
		}
		o, _ := obj.(*T)
		return o
	}
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { changed(nil, as(obj)) },
		UpdateFunc: func(old, cur any) { changed(as(old), as(cur)) },
		DeleteFunc: func(obj any) { changed(as(obj), nil) },
	}
}

type metaObject = metav1.ObjectMeta
