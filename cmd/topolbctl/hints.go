package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/topolb/topolb/hintsim"
)

func init() {
	extraCommands = append(extraCommands, newHintsCommand)
}

func newHintsCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "hints",
		Short: "Inspect the topology hints of EndpointSlices",
		Args:  cobra.NoArgs,
	}
	cmd.AddCommand(newHintsSimulateCommand())
	return cmd
}

func newHintsSimulateCommand() *cobra.Command {
	var (
		src     source
		service string
		output  string
	)
	cmd := &cobra.Command{
		Use:   "simulate [--service NS/NAME] [--from-file F]",
		Short: "Simulate the EndpointSlice controller's topology hints and the load they cause",
		Long: `simulate runs the EndpointSlice controller's own hint code (v1.37,
k8s.io/endpointslice) over the cluster state and reports:

  - per zone, the allocatable CPU and CPU ratio the controller's topology
    cache computes (control-plane and not-Ready nodes excluded), and, when
    that information is insufficient, why, naming the node to blame;
  - per Service whose hints the controller manages (spec.trafficDistribution
    or the service.kubernetes.io/topology-mode: Auto annotation) or whose
    slices carry hints: whether hints would be enabled, the endpoints it
    would hint for each zone, and the TopologyAwareHintsDisabled reason if
    not;
  - the load each zone's endpoints would carry, relative to an even share,
    if every node followed the hints the slices carry now, flagging more
    than 20% overload;
  - beside it, what topolb's zone-weighted routing (topolb.io/zone-weighted)
    would do on the same cluster: the share of each zone's new flows kept
    in the zone, and the highest load on the zone's endpoints;
  - a warning for every endpoint whose current hints differ from the
    controller's.

Cluster state comes from --from-file or from the cluster, as for explain.`,
		Example: `  topolbctl hints simulate --from-file cluster.yaml
  topolbctl hints simulate --service default/web -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "table" && output != "json" && output != "yaml" {
				return usageError(fmt.Errorf("-o %q: want table, json or yaml", output))
			}
			var only *types.NamespacedName
			if service != "" {
				ns, name, ok := strings.Cut(service, "/")
				if !ok || ns == "" || name == "" {
					return usageError(fmt.Errorf("--service %q: want NAMESPACE/NAME", service))
				}
				only = &types.NamespacedName{Namespace: ns, Name: name}
			}
			objs, err := src.load(cmd.Context(), cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			rep, warnings, err := hintsim.Simulate(objs, only, hintsim.DefaultOptions())
			if err != nil {
				return usageError(fmt.Errorf("hints simulate: %w", err))
			}
			if only != nil && !hasService(objs.Services, *only) {
				warnings = append(warnings, fmt.Sprintf("service %s not found", only))
			}
			warn(cmd.ErrOrStderr(), cells(warnings, maxText))
			return printHints(cmd.OutOrStdout(), rep, output)
		},
	}
	src.addFlags(cmd)
	cmd.Flags().StringVar(&service, "service", "", "only this service, as NAMESPACE/NAME")
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table, json or yaml")
	return cmd
}

func printHints(w io.Writer, r hintsim.Report, output string) error {
	if output != "table" {
		return printStructured(w, r, output)
	}
	printNodeInfo(w, r.Nodes)
	if len(r.Services) == 0 {
		fmt.Fprintln(w, "\nNo Service has hints or asks for them.")
	}
	for _, s := range r.Services {
		fmt.Fprintln(w)
		printHintService(w, s)
	}
	return nil
}

func printNodeInfo(w io.Writer, n hintsim.NodeInfo) {
	if n.Sufficient {
		fmt.Fprintf(w, "Node information: sufficient (%d zones)\n", len(n.Zones))
	} else {
		fmt.Fprintf(w, "Node information: INSUFFICIENT: %s\n", cell(n.Reason, maxText))
	}
	if len(n.Ignored) > 0 {
		parts := make([]string, 0, len(n.Ignored))
		for _, i := range n.Ignored {
			parts = append(parts, fmt.Sprintf("%s (%s)", cell(i.Node, maxName), i.Reason))
		}
		fmt.Fprintf(w, "Ignored nodes: %s\n", strings.Join(parts, ", "))
	}
	if len(n.Zones) == 0 {
		return
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ZONE\tNODES\tCPU\tCPU RATIO")
	for _, z := range n.Zones {
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\n", cell(z.Zone, maxName), z.Nodes, z.CPU, optFloat(z.CPURatio, "%.4f"))
	}
	tw.Flush()
}

func printHintService(w io.Writer, s hintsim.Service) {
	how := string(s.Method)
	if s.Trigger != "" {
		how += " (" + cell(s.Trigger, maxName) + ")"
	}
	state := "hints disabled"
	if s.HintsEnabled {
		state = "hints enabled"
	}
	if s.Method == hintsim.MethodUnmanaged {
		state = "not managed by the controller"
	}
	fmt.Fprintf(w, "%s (%s): %s, %s, %d ready %s\n", cell(s.Service, maxName), s.Family, how, state, s.ReadyEndpoints, pluralWord(s.ReadyEndpoints, "endpoint", "endpoints"))
	if s.DisabledReason != "" {
		reason := s.DisabledReason
		if s.DisabledDetail != "" {
			reason += " (" + s.DisabledDetail + ")"
		}
		fmt.Fprintf(w, "  TopologyAwareHintsDisabled: %s\n", cell(reason, maxText))
	}
	if len(s.Zones) > 0 {
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "  ZONE\tCPU RATIO\tENDPOINTS\tHINTED NOW\tCONTROLLER WOULD HINT\tLOAD WITH CURRENT HINTS\tZONE-WEIGHTED: IN-ZONE\tLOAD")
		for _, z := range s.Zones {
			load := optFloat(z.ExpectedLoad, "%.2fx")
			if z.Overloaded {
				load += " OVERLOADED"
			}
			var inZone *float64
			if z.ZoneWeightedShare != nil {
				pct := *z.ZoneWeightedShare * 100
				inZone = &pct
			}
			fmt.Fprintf(tw, "  %s\t%s\t%d\t%d\t%d\t%s\t%s\t%s\n", cell(z.Zone, maxName), optFloat(z.CPURatio, "%.4f"), z.Endpoints, z.CurrentHints, z.Allocation, load,
				optFloat(inZone, "%.0f%%"), optFloat(z.ZoneWeightedLoad, "%.2fx"))
		}
		tw.Flush()
	}
	for _, n := range s.Notes {
		fmt.Fprintf(w, "  note: %s\n", cell(n, maxText))
	}
	for _, warning := range s.Warnings {
		fmt.Fprintf(w, "  warning: %s\n", cell(warning, maxText))
	}
}

// optFloat formats f, or "-" when it is unknown.
func optFloat(f *float64, format string) string {
	if f == nil {
		return "-"
	}
	return fmt.Sprintf(format, *f)
}

func pluralWord(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

func hasService(svcs []*v1.Service, nn types.NamespacedName) bool {
	for _, s := range svcs {
		if s.Namespace == nn.Namespace && s.Name == nn.Name {
			return true
		}
	}
	return false
}
