package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"

	"github.com/topolb/topolb/kube"
)

// source is where a command reads cluster state from: a manifest file or a
// live cluster.
type source struct {
	fromFile   string
	kubeconfig string
}

func (s *source) addFlags(cmd *cobra.Command) {
	cmd.Flags().StringVar(&s.fromFile, "from-file", "", "read Nodes, Services and EndpointSlices from this YAML/JSON manifest file instead of a cluster")
	cmd.Flags().StringVar(&s.kubeconfig, "kubeconfig", "", "kubeconfig of the cluster to read (default: $KUBECONFIG, in-cluster, ~/.kube/config)")
}

// load reads the objects and prints warnings to stderr. A malformed manifest
// is a usage error (exit 2). A manifest is read by the loader the agent's
// --from-file uses, so both decide from the same objects; one the agent
// would refuse to apply as empty is decided here too, with a warning.
func (s *source) load(ctx context.Context, stderr io.Writer) (*kube.Objects, error) {
	if s.fromFile != "" {
		objs, warnings, err := kube.LoadManifests(s.fromFile)
		if err != nil {
			return nil, usageError(err)
		}
		warn(stderr, warnings)
		if objs.Empty() {
			warn(stderr, []string{s.fromFile + ": it holds no Node, Service or EndpointSlice: topolb-agent --from-file would keep its last good state instead of applying it (unless --allow-empty-cluster)"})
		}
		return objs, nil
	}
	cs, err := s.client()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	return kube.ListObjects(ctx, cs)
}

// client returns a client of the cluster in --kubeconfig.
func (s *source) client() (kubernetes.Interface, error) {
	cfg, err := kube.RESTConfig(s.kubeconfig)
	if err != nil {
		return nil, err
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("create client: %w", err)
	}
	return cs, nil
}

// warn prints each warning on its own line.
func warn(stderr io.Writer, warnings []string) {
	for _, w := range warnings {
		fmt.Fprintln(stderr, "warning:", w)
	}
}

// printStructured writes v as indented JSON or as YAML.
func printStructured(w io.Writer, v any, output string) error {
	var b []byte
	var err error
	if output == "yaml" {
		b, err = yaml.Marshal(v)
	} else {
		b, err = json.MarshalIndent(v, "", "  ")
		b = append(b, '\n')
	}
	if err != nil {
		return err
	}
	_, err = w.Write(b)
	return err
}
