package main

import (
	"context"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/topolb/topolb/internal/portrange"
	"github.com/topolb/topolb/kube"
	"github.com/topolb/topolb/topology"
)

func newExplainCommand() *cobra.Command {
	var (
		src       source
		node      string
		service   string
		output    string
		agentAddr string
		nodePorts nodePortFlags
		summaryNS string
	)
	cmd := &cobra.Command{
		Use:   "explain --node NAME [--service NS/NAME] [--from-file F]",
		Short: "Explain which backends a node sends each service port's traffic to, and why",
		Long: `explain decides, for one node, every proxied service port exactly as the topolb
agent on that node does, in each IP family of the Service (a dual-stack
Service's ports once in IPv4 and once in IPv6, each from its own
EndpointSlices, as kube-proxy's two proxiers decide them): the policy
(Hints, Disabled, TopologyKeys, ZoneThreshold, ZoneWeighted), the topology
mode, the reason, and the internal and external backends with each one's
share of new flows. Then it
lists every frontend the node programs (cluster IPs, externalIPs,
load-balancer IPs, NodePorts on the node's addresses), for traffic from
inside the node and from outside, with the backends each uses.

Cluster state comes from --from-file (YAML documents and/or kind: List, JSON
too) or from the cluster in --kubeconfig, $KUBECONFIG or the in-cluster
configuration. Objects that cannot be used are reported as warnings on
stderr; the rest is still decided.

From a cluster it decides from every Node, as an agent with
--node-watch=all; it also reads the topology summary that agents with
--node-watch=own read instead (in --summary-namespace), and warns about
every port whose policy needs data of other nodes the summary lacks (such
agents decide it by hints until it has it) and when the summary is out of
date (they keep its last known inputs). With --agent, the agent's own
reasons say so.`,
		Example: `  topolbctl explain --from-file cluster.yaml --node node-a1
  topolbctl explain --node node-a1 --service default/web -o json
  topolbctl explain --agent 127.0.0.1:9966   # the live decisions and map contents of the agent on this node`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "table" && output != "json" && output != "yaml" {
				return usageError(fmt.Errorf("-o %q: want table, json or yaml", output))
			}
			if agentAddr != "" {
				// The agent decides for its own node from its own
				// inputs: a flag that selects another would be ignored.
				for _, name := range []string{"node", "from-file", "kubeconfig", "summary-namespace", "nodeport-addresses", "service-node-port-range", "cluster-ips-from-outside"} {
					if cmd.Flags().Changed(name) {
						return usageError(fmt.Errorf("--%s does not apply with --agent: the agent decides for its own node, from its own inputs and flags", name))
					}
				}
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
			opts, err := nodePorts.options()
			if err != nil {
				return usageError(err)
			}
			objs, err := src.load(cmd.Context(), cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			var sum *summaryRead
			if src.fromFile == "" {
				sum = src.readSummary(cmd.Context(), summaryNS)
			}
			report := explainReport(objs.State(nil), node, filter, opts, sum)
			warn(cmd.ErrOrStderr(), cells(report.Warnings, maxText))
			return printReport(cmd.OutOrStdout(), report, output)
		},
	}
	src.addFlags(cmd)
	cmd.Flags().StringVar(&node, "node", "", "the node to decide for (required unless --agent)")
	cmd.Flags().StringVar(&agentAddr, "agent", "", "read the live decisions and programmed maps from the agent's health address (host:port) instead of deciding here")
	cmd.Flags().StringVar(&service, "service", "", "only this service, as NAMESPACE/NAME")
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table, json or yaml")
	cmd.Flags().StringVar(&summaryNS, "summary-namespace", "topolb-system", "namespace of the topology summary that agents with --node-watch=own read (topolb's), read with a cluster to warn about the ports it lacks data for")
	nodePorts.addFlags(cmd)
	return cmd
}

// explainReport decides every Service for node, assembles the node's
// frontends (conflicts between Services need all of them), and keeps what
// concerns filter when it is set. The report's warnings are the decisions'
// followed by the frontends', and, when sum is not nil, what the topology
// summary lacks (summaryWarnings).
func explainReport(state *topology.State, node string, filter *types.NamespacedName, opts topology.Options, sum *summaryRead) topology.Report {
	ds, warnings := state.DecideNode(node, opts)
	n, _ := state.Node(node)
	report := topology.NewReportOptions(n, ds, opts)
	report.Skipped = state.Skipped()
	if filter != nil {
		report = report.Only(*filter)
		warnings = nil
		if _, ok := state.Services[*filter]; !ok {
			warnings = append(warnings, fmt.Sprintf("service %s not found", filter))
		}
		_, w := state.DecideService(node, *filter, opts)
		warnings = append(warnings, w...)
	}
	if sum != nil {
		warnings = append(warnings, sum.warnings(ds, filter)...)
	}
	// Never null, as the JSON contract says.
	report.Warnings = append(append([]string{}, warnings...), report.Warnings...)
	return report
}

// nodePortFlags are the options that choose NodePort frontends.
type nodePortFlags struct {
	addresses          []string
	portRange          string
	clusterFromOutside bool
	caps               topology.Caps
}

func (f *nodePortFlags) addFlags(cmd *cobra.Command) {
	cmd.Flags().StringSliceVar(&f.addresses, "nodeport-addresses", nil, "serve NodePorts on the node's addresses inside these CIDRs, IPv4 and IPv6, as the agent's flag of that name (default, and for a family without a CIDR here: the Node's InternalIP and ExternalIP of that family; a CIDR holding 127.0.0.1 adds it)")
	cmd.Flags().BoolVar(&f.clusterFromOutside, "cluster-ips-from-outside", false, "serve cluster IPs to traffic from outside the node, as the agent's flag of that name")
	cmd.Flags().StringVar(&f.portRange, "service-node-port-range", topology.DefaultNodePortRange.String(), "the valid nodePort range, as the apiserver's flag of that name")
	cmd.Flags().IntVar(&f.caps.SourceRanges, "max-source-ranges-per-service", topology.DefaultCaps.SourceRanges, "refuse a Service with more loadBalancerSourceRanges on its load-balancer IPs, as the agent's flag of that name (0: no cap)")
	cmd.Flags().IntVar(&f.caps.Frontends, "max-frontends-per-service", topology.DefaultCaps.Frontends, "refuse a Service that claims more frontends on the node, as the agent's flag of that name (0: no cap)")
}

// options returns the decision options the flags describe.
func (f *nodePortFlags) options() (topology.Options, error) {
	opts := topology.DefaultOptions()
	var err error
	if opts.NodePortAddresses, err = topology.ParseNodePortAddresses(f.addresses); err != nil {
		return opts, err
	}
	if opts.NodePortRange, err = portrange.Parse(f.portRange); err != nil {
		return opts, fmt.Errorf("--service-node-port-range: %w", err)
	}
	opts.ClusterIPsFromOutside = f.clusterFromOutside
	opts.Caps = f.caps
	return opts, nil
}

func printReport(w io.Writer, r topology.Report, output string) error {
	if output != "table" {
		return printStructured(w, r, output)
	}
	zone := r.Zone
	if zone == "" {
		zone = "(none)"
	}
	fmt.Fprintf(w, "node %s, zone %s\n\n", cell(r.Node, maxName), cell(zone, maxName))
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SERVICE\tPORT\tFAMILY\tPOLICY\tMODE\tBACKENDS BY ZONE\tREASON")
	for _, s := range r.Services {
		port := s.Port
		if port == "" {
			port = "-"
		}
		fmt.Fprintf(tw, "%s\t%s/%s\t%s\t%s\t%s\t%s\t%s\n", cell(s.Service, maxName), cell(port, maxName), s.Protocol, s.Family, s.Policy,
			cell(string(s.Mode), maxName), backendsCell(s), cell(s.Reason, maxText))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if err := printFrontends(w, r.Frontends); err != nil {
		return err
	}
	if err := printSourceRanges(w, r.Frontends); err != nil {
		return err
	}
	return printSkipped(w, r.Skipped)
}

// printSourceRanges lists the frontends that take new flows only from
// some sources (loadBalancerSourceRanges), nothing when none does.
func printSourceRanges(w io.Writer, frontends []topology.FrontendReport) error {
	var rows [][]string
	for _, f := range frontends {
		if len(f.SourceRanges) == 0 {
			continue
		}
		node := "refused"
		if f.NodePasses {
			node = "pass"
		}
		rows = append(rows, []string{f.Address + "/" + f.Protocol, string(f.Scope), strings.Join(f.SourceRanges, " "), node})
	}
	return printSection(w, "FRONTEND\tSCOPE\tONLY FROM (loadBalancerSourceRanges)\tTHIS NODE'S PROCESSES", rows)
}

// printSkipped lists the Services not proxied, as kube-proxy skips them,
// with the reason.
func printSkipped(w io.Writer, skipped []topology.SkippedService) error {
	rows := make([][]string, 0, len(skipped))
	for _, s := range skipped {
		rows = append(rows, []string{cell(s.Service, maxName), cell(s.Reason, maxText)})
	}
	return printSection(w, "NOT PROXIED\tWHY (kube-proxy skips it too)", rows)
}

// printFrontends prints the frontends table, nothing when there are none.
func printFrontends(w io.Writer, frontends []topology.FrontendReport) error {
	rows := make([][]string, 0, len(frontends))
	for _, f := range frontends {
		port := f.Port
		if port == "" {
			port = "-"
		}
		affinity := f.SessionAffinity
		if affinity == "ClientIP" {
			affinity += fmt.Sprintf(" %ds", f.AffinityTimeoutSeconds)
		}
		rows = append(rows, []string{f.Address + "/" + f.Protocol, string(f.Scope), string(f.Kind), cell(f.Service, maxName), cell(port, maxName),
			frontendBackends(f), fmt.Sprint(len(f.DrainingBackends)), affinity})
	}
	return printSection(w, "FRONTEND\tSCOPE\tKIND\tSERVICE\tPORT\tBACKENDS\tDRAINING\tAFFINITY", rows)
}

// printSection prints a blank line and a table of header (tab-separated)
// and rows, or nothing when there are no rows.
func printSection(w io.Writer, header string, rows [][]string) error {
	if len(rows) == 0 {
		return nil
	}
	fmt.Fprintln(w)
	return writeTable(w, header, rows)
}

// writeTable writes header (tab-separated) and rows, aligned.
func writeTable(w io.Writer, header string, rows [][]string) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, header)
	for _, r := range rows {
		fmt.Fprintln(tw, strings.Join(r, "\t"))
	}
	return tw.Flush()
}

// emptyWord says what happens to new flows without a backend.
func emptyWord(a topology.EmptyAction) string {
	if a == topology.EmptyReject {
		return "rejected"
	}
	return "dropped"
}

// maxListedBackends bounds the backends a frontend's table row lists.
const maxListedBackends = 4

// frontendBackends lists a frontend's backends, each with its share of new
// flows when the shares are unequal, at most maxListedBackends of them:
// "10.1.1.1:8080 10.1.1.2:8080", "10.1.14.1:8080=67% ...", "none".
func frontendBackends(f topology.FrontendReport) string {
	if len(f.Backends) == 0 {
		return "none (" + emptyWord(f.WhenEmpty) + ")"
	}
	equal := true
	for _, b := range f.Backends {
		equal = equal && f.Weights[b] == f.Weights[f.Backends[0]]
	}
	var parts []string
	for i, b := range f.Backends {
		if i == maxListedBackends {
			parts = append(parts, fmt.Sprintf("+%d more", len(f.Backends)-i))
			break
		}
		if !equal {
			b += fmt.Sprintf("=%.0f%%", f.Weights[b]*100)
		}
		parts = append(parts, b)
	}
	return strings.Join(parts, " ")
}

// backendsCell renders the backends by zone and, when some drain, how
// many: "zone-a=2 (+1 draining)".
func backendsCell(s topology.PortReport) string {
	cell := zoneCounts(s.BackendZones, s.ZoneShares, len(s.Backends), s.WhenEmpty)
	if n := len(s.DrainingBackends); n > 0 {
		cell += fmt.Sprintf(" (+%d draining)", n)
	}
	return cell
}

// zoneCounts renders "zone-a=2 zone-b=1", or for no backends "0 (dropped)"
// or "0 (rejected)"; with unequal weights, each zone's share of new flows
// follows its count: "zone-a=1:67% zone-b=2:33%".
func zoneCounts(byZone map[string]int, shares map[string]float64, total int, whenEmpty topology.EmptyAction) string {
	if total == 0 {
		return "0 (" + emptyWord(whenEmpty) + ")"
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
		name := cell(z, maxName)
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

// summaryRead is the topology summary as explain read it from the cluster.
type summaryRead struct {
	// summary is nil when none could be read; note then says why.
	summary *topology.Summary
	note    string
	now     time.Time
}

// readSummary reads the topology summary in namespace; a summary that
// cannot be read is a note, not an error: explain decides from every Node.
func (s *source) readSummary(ctx context.Context, namespace string) *summaryRead {
	r := &summaryRead{now: time.Now()}
	cs, err := s.client()
	if err != nil {
		r.note = err.Error()
		return r
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cm, err := cs.CoreV1().ConfigMaps(namespace).Get(ctx, kube.SummaryName, metav1.GetOptions{})
	if err != nil {
		r.note = fmt.Sprintf("read %s/%s: %v", namespace, kube.SummaryName, err)
		return r
	}
	if r.summary, err = topology.DecodeSummary([]byte(cm.Data[topology.SummaryDataKey])); err != nil {
		r.note = fmt.Sprintf("%s/%s: %v", namespace, kube.SummaryName, err)
	}
	return r
}

// warnings says, for each decided port (of filter, when set) whose policy
// needs data of other nodes the summary lacks, that agents with
// --node-watch=own decide it by hints; and, once, when the summary could
// not be read or is out of date (kube.SummaryStaleAfter).
func (r *summaryRead) warnings(ds []topology.PortDecision, filter *types.NamespacedName) []string {
	var out []string
	needed := false
	for _, d := range ds {
		if filter != nil && d.Port.Service != *filter {
			continue
		}
		reads := d.Port.Reads()
		if !reads.Capacity && len(reads.OtherLabels) == 0 {
			continue
		}
		needed = true
		if lacks := r.summary.LacksFor(reads); lacks != "" && r.summary != nil {
			out = append(out, fmt.Sprintf("%s port %s (%s): %s: agents with --node-watch=own decide it by hints until it has it",
				d.Port.Service, d.Port.Name, d.Port.Family, lacks))
		}
	}
	switch {
	case !needed:
	case r.summary == nil:
		out = append(out, fmt.Sprintf("no topology summary (%s): agents with --node-watch=own decide zone-weighted and topology-keys ports by hints until one is written, or from the last one they read", r.note))
	case r.now.Sub(r.summary.Written) > kube.SummaryStaleAfter:
		out = append(out, fmt.Sprintf("the topology summary was last written %s ago: its writer is down, and agents with --node-watch=own decide zone-weighted and topology-keys ports from its last inputs",
			r.now.Sub(r.summary.Written).Round(time.Second)))
	}
	return out
}
