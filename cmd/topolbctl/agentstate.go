package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/topolb/topolb/agent"
	dpmaps "github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

// explainAgent prints the live state of the agent at addr: its decisions
// and what its maps hold, flagging any frontend whose programmed backends
// differ from the decision.
func explainAgent(cmd *cobra.Command, addr, service, output string) error {
	st, err := fetchAgentState(cmd, addr)
	if err != nil {
		return err
	}
	if service != "" {
		ns, name, ok := strings.Cut(service, "/")
		if !ok || ns == "" || name == "" {
			return usageError(fmt.Errorf("--service %q: want NAMESPACE/NAME", service))
		}
		st.Report = st.Report.Only(types.NamespacedName{Namespace: ns, Name: name})
	}
	w := cmd.OutOrStdout()
	if output != "table" {
		if err := printStructured(w, st, output); err != nil {
			return err
		}
		if st.DatapathError != "" {
			return fmt.Errorf("the agent could not read its maps: %s", st.DatapathError)
		}
		return nil
	}
	// Zone counts are not part of the JSON the agent sends: the table shows
	// the number of backends only.
	if err := printReport(w, st.Report, "table"); err != nil {
		return err
	}
	if st.DatapathError != "" {
		return fmt.Errorf("the agent could not read its maps: %s", st.DatapathError)
	}
	fmt.Fprintf(w, "\nprogrammed maps, read back from the kernel (first sync written: %v; families programmed: %s)\n", st.Synced, st.ProgrammedFamilies())
	decided := decidedFrontends(st.Report)
	keys := make([]string, 0, len(st.Datapath)+len(decided))
	for f := range st.Datapath {
		keys = append(keys, f)
	}
	for f := range decided {
		if _, ok := st.Datapath[f]; !ok {
			keys = append(keys, f)
		}
	}
	sort.Strings(keys)
	for _, f := range keys {
		want, isDecided := decided[f]
		got, isProgrammed := st.Datapath[f]
		if service != "" && !isDecided {
			continue
		}
		var marks []string
		switch {
		case !isProgrammed && !st.ProgrammedFamilies().Programs(want.Family, want.Scope):
			marks = append(marks, fmt.Sprintf("(decided, not programmed: the agent's datapath does not serve %s in scope %s)", want.Family, want.Scope))
		case !isProgrammed:
			marks = append(marks, "MISSING: decided but not in the maps")
		case !isDecided:
			marks = append(marks, "(not decided: stale or owned by no service)")
		default:
			if !slices.Equal(want.Backends, got.Backends) {
				marks = append(marks, fmt.Sprintf("MISMATCH: decided %v", want.Backends))
			}
			// Draining backends are programmed only when they were active
			// here before (otherwise no flow of this node can use them), so
			// the maps hold a subset of the decided ones.
			if extra := slices.DeleteFunc(slices.Clone(got.DrainingBackends), func(b string) bool {
				return slices.Contains(want.DrainingBackends, b)
			}); len(extra) > 0 {
				marks = append(marks, fmt.Sprintf("MISMATCH: draining %v, which the decision does not keep", extra))
			}
			programmed, decided := slices.Sorted(slices.Values(got.SourceRanges)), slices.Sorted(slices.Values(want.SourceRanges))
			if !slices.Equal(programmed, decided) || got.NodePasses != want.NodePasses {
				marks = append(marks, fmt.Sprintf("MISMATCH: source ranges %v (node passes: %v), decided %v (%v)", programmed, got.NodePasses, decided, want.NodePasses))
			}
		}
		for _, p := range got.Problems {
			marks = append(marks, "PROBLEM: "+cell(p, maxText))
		}
		line := fmt.Sprintf("  %s -> [%s]", cell(f, maxName), cell(strings.Join(got.Backends, " "), maxText))
		if len(got.DrainingBackends) > 0 {
			line += fmt.Sprintf(" draining [%s]", cell(strings.Join(got.DrainingBackends, " "), maxText))
		}
		if len(marks) > 0 {
			line += "   " + strings.Join(marks, "; ")
		}
		fmt.Fprintln(w, line)
	}
	if err := printUplinks(w, st); err != nil {
		return err
	}
	return printKernel(w, st.Kernel)
}

// familyList renders families, "IPv4 IPv6".
func familyList(families []v1.IPFamily) string {
	parts := make([]string, 0, len(families))
	for _, f := range families {
		parts = append(parts, string(f))
	}
	return strings.Join(parts, " ")
}

// printKernel lists the kernel's features the datapath probed at load,
// the path the agent chose for each that has a choice, and what it does
// where one is missing.
func printKernel(w io.Writer, k *dpmaps.KernelReport) error {
	if k == nil {
		return nil
	}
	fmt.Fprintf(w, "\nkernel %s, probed at load\n", k.Release)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "FEATURE\tSINCE\tPRESENT\tPATH\tWITHOUT IT")
	for _, f := range k.Features {
		present, path, without := "yes", "-", "-"
		if !f.Present {
			present, without = "no", f.Without
		}
		if f.Path != "" {
			path = f.Path
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", f.Name, f.Since, present, path, cell(without, maxText))
	}
	return tw.Flush()
}

// printUplinks lists the agent's uplinks and the path each takes, as the
// kernel has them (the programs attached), with the agent's reason.
func printUplinks(w io.Writer, st agent.DebugState) error {
	if st.UplinksError != "" {
		fmt.Fprintf(w, "\nuplinks: cannot be read: %s\n", cell(st.UplinksError, maxText))
		return nil
	}
	if len(st.Uplinks) == 0 {
		return nil
	}
	fmt.Fprintln(w, "\nuplinks, read back from the kernel")
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "INTERFACE\tPATH\tPROGRAMS\tREASON")
	for _, u := range st.Uplinks {
		reason := u.Reason
		if reason == "" {
			reason = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", cell(u.Interface, maxName), u.Path, strings.Join(u.Programs, " "), cell(reason, maxText))
	}
	return tw.Flush()
}

// decidedFrontends maps the frontends the report decides, keyed as the
// agent keys what the kernel holds (agent.ReportKey), to their decided
// sets.
func decidedFrontends(r topology.Report) map[string]topology.FrontendReport {
	out := map[string]topology.FrontendReport{}
	for _, f := range r.Frontends {
		if key, ok := agent.ReportKey(f); ok {
			out[key] = f
		}
	}
	return out
}

func fetchAgentState(cmd *cobra.Command, addr string) (agent.DebugState, error) {
	var st agent.DebugState
	url := addr
	if !strings.Contains(url, "://") {
		url = "http://" + url
	}
	c := &http.Client{Timeout: 10 * time.Second}
	req, err := http.NewRequestWithContext(cmd.Context(), http.MethodGet, strings.TrimSuffix(url, "/")+"/debug/state", nil)
	if err != nil {
		return st, usageError(fmt.Errorf("--agent %q: %w", addr, err))
	}
	resp, err := c.Do(req)
	if err != nil {
		return st, fmt.Errorf("read agent state: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return st, fmt.Errorf("read agent state: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return st, fmt.Errorf("read agent state: %s: %s", resp.Status, strings.TrimSpace(string(body)))
	}
	if err := json.Unmarshal(body, &st); err != nil {
		return st, fmt.Errorf("decode agent state: %w", err)
	}
	return st, nil
}
