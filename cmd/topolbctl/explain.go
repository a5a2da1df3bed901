package main

import (
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"
	"k8s.io/apimachinery/pkg/types"

	"github.com/topolb/topolb/topology"
)

func newExplainCommand() *cobra.Command {
	var (
		src       source
		node      string
		service   string
		output    string
		agentAddr string
	)
	cmd := &cobra.Command{
		Use:   "explain --node NAME [--service NS/NAME] [--from-file F]",
		Short: "Explain which backends a node sends each service port's traffic to, and why",
		Long: `explain decides, for one node, every proxied service port exactly as the topolb
agent on that node does: the policy (Hints, Disabled, TopologyKeys,
ZoneThreshold, ZoneWeighted), the topology mode, the reason, and the
internal and external backends with each one's share of new flows.

Cluster state comes from --from-file (YAML documents and/or kind: List, JSON
too) or from the cluster in --kubeconfig, $KUBECONFIG or the in-cluster
configuration. Objects that cannot be used are reported as warnings on
stderr; the rest is still decided.`,
		Example: `  topolbctl explain --from-file cluster.yaml --node node-a1
  topolbctl explain --node node-a1 --service default/web -o json
  topolbctl explain --agent 127.0.0.1:9966   # the live decisions and map contents of the agent on this node`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "table" && output != "json" && output != "yaml" {
				return usageError(fmt.Errorf("-o %q: want table, json or yaml", output))
			}
			if agentAddr != "" {
				return explainAgent(cmd, agentAddr, service, output)
			}
			if node == "" {
				return usageError(fmt.Errorf("--node is required (or --agent)"))
			}
			var filter *types.NamespacedName
			if service != "" {
				ns, name, ok := strings.Cut(service, "/")
				if !ok || ns == "" || name == "" {
					return usageError(fmt.Errorf("--service %q: want NAMESPACE/NAME", service))
				}
				filter = &types.NamespacedName{Namespace: ns, Name: name}
			}
			objs, err := src.load(cmd.Context(), cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			state := objs.State(nil)
			var ds []topology.PortDecision
			var warnings []string
			if filter != nil {
				if _, ok := state.Services[*filter]; !ok {
					warnings = append(warnings, fmt.Sprintf("service %s not found", filter))
				}
				var w []string
				ds, w = state.DecideService(node, *filter, topology.DefaultOptions())
				warnings = append(warnings, w...)
			} else {
				ds, warnings = state.DecideNode(node, topology.DefaultOptions())
			}
			warn(cmd.ErrOrStderr(), warnings)
			n, _ := state.Node(node)
			return printReport(cmd.OutOrStdout(), topology.NewReport(n, ds), output)
		},
	}
	src.addFlags(cmd)
	cmd.Flags().StringVar(&node, "node", "", "the node to decide for (required unless --agent)")
	cmd.Flags().StringVar(&agentAddr, "agent", "", "read the live decisions and programmed maps from the agent's health address (host:port) instead of deciding here")
	cmd.Flags().StringVar(&service, "service", "", "only this service, as NAMESPACE/NAME")
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table, json or yaml")
	return cmd
}

func printReport(w io.Writer, r topology.Report, output string) error {
	if output != "table" {
		return printStructured(w, r, output)
	}
	zone := r.Zone
	if zone == "" {
		zone = "(none)"
	}
	fmt.Fprintf(w, "node %s, zone %s\n\n", r.Node, zone)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SERVICE\tPORT\tPOLICY\tMODE\tBACKENDS BY ZONE\tREASON")
	for _, s := range r.Services {
		port := s.Port
		if port == "" {
			port = "-"
		}
		fmt.Fprintf(tw, "%s\t%s/%s\t%s\t%s\t%s\t%s\n", s.Service, port, s.Protocol, s.Policy, s.Mode, backendsCell(s), s.Reason)
	}
	return tw.Flush()
}

// backendsCell renders the backends by zone and, when some drain, how
// many: "zone-a=2 (+1 draining)".
func backendsCell(s topology.PortReport) string {
	cell := zoneCounts(s.BackendZones, s.ZoneShares, len(s.Backends))
	if n := len(s.DrainingBackends); n > 0 {
		cell += fmt.Sprintf(" (+%d draining)", n)
	}
	return cell
}

// zoneCounts renders "zone-a=2 zone-b=1" or "0 (dropped)"; with unequal
// weights, each zone's share of new flows follows its count:
// "zone-a=1:67% zone-b=2:33%".
func zoneCounts(byZone map[string]int, shares map[string]float64, total int) string {
	if total == 0 {
		return "0 (dropped)"
	}
	if len(byZone) == 0 {
		return fmt.Sprint(total)
	}
	zones := make([]string, 0, len(byZone))
	for z := range byZone {
		zones = append(zones, z)
	}
	sort.Strings(zones)
	parts := make([]string, 0, len(zones))
	for _, z := range zones {
		name := z
		if name == "" {
			name = "(no zone)"
		}
		part := fmt.Sprintf("%s=%d", name, byZone[z])
		if shares != nil {
			part += fmt.Sprintf(":%.0f%%", shares[z]*100)
		}
		parts = append(parts, part)
	}
	return strings.Join(parts, " ")
}
