package kube

import (
	"context"
	"fmt"
	"os"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// RESTConfig returns the client configuration from, in order: the kubeconfig
// path given, the KUBECONFIG environment variable, the in-cluster
// configuration, and ~/.kube/config. It asks for protobuf, as kube-proxy
// does: smaller responses, and less CPU and garbage decoding the initial
// lists of thousands of Services and EndpointSlices than JSON.
func RESTConfig(kubeconfig string) (*rest.Config, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	if kubeconfig != "" {
		rules.ExplicitPath = kubeconfig
	} else if os.Getenv(clientcmd.RecommendedConfigPathEnvVar) == "" {
		if cfg, err := rest.InClusterConfig(); err == nil {
			return withProtobuf(cfg), nil
		}
	}
	cfg, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, nil).ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("load kubeconfig: %w", err)
	}
	return withProtobuf(cfg), nil
}

// withProtobuf makes cfg speak protobuf to the built-in types it reads
// (every object topolb watches is one), JSON where a response has no
// protobuf form.
func withProtobuf(cfg *rest.Config) *rest.Config {
	cfg.ContentType = runtime.ContentTypeProtobuf
	cfg.AcceptContentTypes = runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON
	return cfg
}

// ListObjects reads every Node, Service and EndpointSlice from the cluster.
func ListObjects(ctx context.Context, c kubernetes.Interface) (*Objects, error) {
	objs := &Objects{}
	nodes, err := c.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list nodes: %w", err)
	}
	for i := range nodes.Items {
		objs.Nodes = append(objs.Nodes, &nodes.Items[i])
	}
	svcs, err := c.CoreV1().Services(metav1.NamespaceAll).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list services: %w", err)
	}
	for i := range svcs.Items {
		objs.Services = append(objs.Services, &svcs.Items[i])
	}
	slices, err := c.DiscoveryV1().EndpointSlices(metav1.NamespaceAll).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list endpointslices: %w", err)
	}
	for i := range slices.Items {
		objs.Slices = append(objs.Slices, &slices.Items[i])
	}
	return objs, nil
}
