package kube

import (
	"context"
	"fmt"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// Watch starts shared informers for Services, EndpointSlices and Nodes that
// feed t, waits for their caches to sync, then asks t for a full resync.
// The informers stop when ctx is done.
func Watch(ctx context.Context, c kubernetes.Interface, t *Tracker) error {
	f := informers.NewSharedInformerFactory(c, 0)
	svc := f.Core().V1().Services().Informer()
	es := f.Discovery().V1().EndpointSlices().Informer()
	nodes := f.Core().V1().Nodes().Informer()
	// Keep only what decisions read, so 100,000 endpoints' managedFields
	// and node statuses do not stay in memory.
	for _, inf := range []cache.SharedIndexInformer{svc, es, nodes} {
		if err := inf.SetTransform(trim); err != nil {
			return fmt.Errorf("set informer transform: %w", err)
		}
	}
	if _, err := svc.AddEventHandler(handler(t.ServiceChanged)); err != nil {
		return fmt.Errorf("watch services: %w", err)
	}
	if _, err := es.AddEventHandler(handler(t.SliceChanged)); err != nil {
		return fmt.Errorf("watch endpointslices: %w", err)
	}
	if _, err := nodes.AddEventHandler(handler(t.NodeChanged)); err != nil {
		return fmt.Errorf("watch nodes: %w", err)
	}
	f.Start(ctx.Done())
	synced := f.WaitForCacheSync(ctx.Done())
	for typ, ok := range synced {
		if !ok {
			return fmt.Errorf("informer cache for %v did not sync: %w", typ, ctx.Err())
		}
	}
	t.Resync()
	return nil
}

// trim drops the parts of objects topolb never reads.
func trim(obj any) (any, error) {
	switch o := obj.(type) {
	case *v1.Node:
		return &v1.Node{TypeMeta: o.TypeMeta, ObjectMeta: trimMeta(o.ObjectMeta, true), Status: trimNodeStatus(o.Status)}, nil
	case *v1.Service:
		o.ObjectMeta = trimMeta(o.ObjectMeta, false)
		return o, nil
	case *discovery.EndpointSlice:
		o.ObjectMeta = trimMeta(o.ObjectMeta, true)
		return o, nil
	}
	return obj, nil
}

// trimNodeStatus keeps what topology.NodeFromObject reads of a Node's
// status: its addresses (where NodePorts are served), allocatable CPU and
// Ready condition.
func trimNodeStatus(s v1.NodeStatus) v1.NodeStatus {
	out := v1.NodeStatus{Addresses: s.Addresses}
	if cpu, ok := s.Allocatable[v1.ResourceCPU]; ok {
		out.Allocatable = v1.ResourceList{v1.ResourceCPU: cpu}
	}
	for _, c := range s.Conditions {
		if c.Type == v1.NodeReady {
			out.Conditions = []v1.NodeCondition{{Type: c.Type, Status: c.Status}}
		}
	}
	return out
}

func trimMeta(m metaObject, keepLabels bool) metaObject {
	out := metaObject{Name: m.Name, Namespace: m.Namespace, ResourceVersion: m.ResourceVersion, UID: m.UID, Annotations: topolbAnnotations(m.Annotations)}
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
