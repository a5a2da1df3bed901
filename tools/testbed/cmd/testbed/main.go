// Command testbed stands up a topolb testbed from a YAML spec and keeps it
// until Ctrl-C, prints the manifest a spec generates, and removes what
// crashed runs left behind.
//
//	testbed up [-f spec.yaml] [--scenario NAME] [--datapath none|direct|agent --agent-binary BIN] [--kube]
//	testbed manifest [-f spec.yaml] [--scenario NAME]
//	testbed clean
//
// Without -f the spec is tools/testbed/examples/demo.yaml.
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/topolb/topolb/internal/kubetest"
	"github.com/topolb/topolb/tools/testbed"
)

func main() {
	root := &cobra.Command{
		Use:           "testbed",
		Short:         "A multi-zone cluster network out of network namespaces, for topolb",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(upCommand(), manifestCommand(), cleanCommand())
	if err := root.Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}

func loadSpec(path string) (*testbed.Spec, error) {
	if path == "" {
		return testbed.DemoSpec()
	}
	return testbed.LoadSpec(path)
}

func upCommand() *cobra.Command {
	var (
		file, scenario, datapath, agentBin string
		verbose, useKube, plainPorts       bool
	)
	cmd := &cobra.Command{
		Use:   "up",
		Short: "Create the testbed and keep it until Ctrl-C",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			spec, err := loadSpec(file)
			if err != nil {
				return err
			}
			level := slog.LevelInfo
			if verbose {
				level = slog.LevelDebug
			}
			log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			tb, err := testbed.New(ctx, spec, testbed.Options{Logger: log, PlainSwitchPorts: plainPorts})
			if err != nil {
				return err
			}
			defer func() {
				if cerr := tb.Close(); cerr != nil {
					fmt.Fprintln(os.Stderr, "teardown:", cerr)
				}
			}()
			if scenario != "" {
				if _, _, err := tb.ApplyScenario(ctx, scenario); err != nil {
					return err
				}
			}
			if useKube {
				cluster, err := kubetest.Run(ctx)
				if err != nil {
					return err
				}
				defer cluster.Close()
				// Agents before the apiserver: it would drain their watches.
				defer tb.Close()
				if err := tb.ConnectAPIServer(ctx, cluster.Config); err != nil {
					return err
				}
				fmt.Printf("kube-apiserver at %s; kubeconfig %s (from inside a node: %s)\n", cluster.URL, cluster.KubeconfigPath, filepath.Join(tb.Dir, "kubeconfig-<node>"))
			}
			switch datapath {
			case "none":
			case "direct":
				if _, err := tb.AttachDirect(); err != nil {
					return err
				}
			case "agent":
				if _, err := tb.StartAgents(ctx, testbed.AgentOptions{Binary: agentBin}); err != nil {
					return err
				}
			default:
				return fmt.Errorf("--datapath %q: want none, direct or agent", datapath)
			}
			printSummary(tb)
			fmt.Println("\nCtrl-C tears everything down.")
			<-ctx.Done()
			return nil
		},
	}
	cmd.Flags().StringVarP(&file, "file", "f", "", "testbed spec (default: the demo spec)")
	cmd.Flags().StringVar(&scenario, "scenario", "", "apply this scenario's Services instead of the spec's")
	cmd.Flags().StringVar(&datapath, "datapath", "none", "who programs the nodes: none, direct (in this process) or agent")
	cmd.Flags().StringVar(&agentBin, "agent-binary", "bin/topolb-agent", "topolb-agent binary for --datapath agent")
	cmd.Flags().BoolVarP(&verbose, "verbose", "v", false, "log details")
	cmd.Flags().BoolVar(&useKube, "kube", false, "also serve the objects from a real kube-apiserver (make kube-bins); agents then watch it")
	cmd.Flags().BoolVar(&plainPorts, "plain-switch-ports", false, "give the nodes' switch ports no XDP program (no NAPI), as a kind node's eth0 has its peer on the host's bridge: the agents' uplinks then take the tc path")
	return cmd
}

// both renders an address or prefix, and its IPv6 twin after a comma in
// a dual-stack testbed.
func both[T interface {
	IsValid() bool
	String() string
}](v4, v6 T) string {
	if !v6.IsValid() {
		return v4.String()
	}
	return v4.String() + "," + v6.String()
}

func printSummary(tb *testbed.Testbed) {
	fmt.Printf("testbed %s: manifest %s\n\n", tb.ID, tb.ManifestPath())
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "NODE\tZONE\tWIRE\tPOD CIDR\tNAMESPACE")
	for _, n := range tb.Nodes {
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\n", n.Name, n.Zone, both(n.WireAddr, n.WireAddr6), both(n.PodCIDR, n.PodCIDR6), n.NS.Name)
	}
	w.Flush()
	fmt.Println()
	fmt.Fprintln(w, "POD\tROLE\tNODE\tADDRESS\tHOST VETH\tNAMESPACE")
	for _, p := range tb.Pods {
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\n", p.Name, p.Role, p.Node.Name, both(p.Addr, p.Addr6), p.HostVeth, p.NS.Name)
	}
	w.Flush()
	if r := tb.Router; r != nil {
		fmt.Printf("\nrouter %s on the wire, outside subnet %s, external and LB IPs to %s: %s\n", both(r.WireAddr, r.WireAddr6), both(r.Subnet, r.Subnet6), r.Ingress.Name, r.NS.Name)
		fmt.Fprintln(w, "OUTSIDE CLIENT\tADDRESS\tROUTER VETH\tNAMESPACE")
		for _, e := range tb.Externals {
			fmt.Fprintf(w, "%s\t%s\t%s\t%s\n", e.Name, both(e.Addr, e.Addr6), e.RouterIf, e.NS.Name)
		}
		w.Flush()
	}
	if c := tb.Clients(); len(c) > 0 {
		fmt.Printf("\ntry: nsenter --net=%s curl -s http://10.96.0.10/\n", c[0].NS.Path)
	}
}

func manifestCommand() *cobra.Command {
	var file, scenario string
	cmd := &cobra.Command{
		Use:   "manifest",
		Short: "Print the Nodes, Services and EndpointSlices a spec (or one of its scenarios) describes",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			spec, err := loadSpec(file)
			if err != nil {
				return err
			}
			l, err := testbed.NewLayout(spec)
			if err != nil {
				return err
			}
			svcs := spec.Services
			if scenario != "" {
				sc, err := spec.Scenario(scenario)
				if err != nil {
					return err
				}
				svcs = sc.Services
			}
			objs, err := l.Objects(svcs)
			if err != nil {
				return err
			}
			data, err := testbed.EncodeManifest(objs)
			if err != nil {
				return err
			}
			_, err = os.Stdout.Write(data)
			return err
		},
	}
	cmd.Flags().StringVarP(&file, "file", "f", "", "testbed spec (default: the demo spec)")
	cmd.Flags().StringVar(&scenario, "scenario", "", "the scenario whose Services to print")
	return cmd
}

func cleanCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "clean",
		Short: "Remove namespaces, pins and agents left by testbeds whose process is gone",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			err := testbed.RemoveStale("")
			if errors.Is(err, context.Canceled) {
				return nil
			}
			return err
		},
	}
}
