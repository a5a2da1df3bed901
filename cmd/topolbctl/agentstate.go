package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/apimachinery/pkg/types"

	"github.com/topolb/topolb/agent"
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
		return printStructured(w, st, output)
	}
	// Zone counts are not part of the JSON the agent sends: the table shows
	// the number of backends only.
	if err := printReport(w, st.Report, "table"); err != nil {
		return err
	}
	fmt.Fprintf(w, "\nprogrammed maps (first sync written: %v)\n", st.Synced)
	frontends := make([]string, 0, len(st.Programmed))
	for f := range st.Programmed {
		frontends = append(frontends, f)
	}
	sort.Strings(frontends)
	decided := decidedBackends(st.Report)
	for _, f := range frontends {
		want, ok := decided[f]
		if service != "" && !ok {
			continue
		}
		mark := ""
		switch {
		case ok && !slices.Equal(want, st.Programmed[f]):
			mark = fmt.Sprintf("   MISMATCH: decided %v", want)
		case !ok:
			mark = "   (not decided: stale or owned by no service)"
		}
		fmt.Fprintf(w, "  %s -> [%s]%s\n", cell(f, maxName), cell(strings.Join(st.Programmed[f], " "), maxText), mark)
	}
	return nil
}

// decidedBackends maps "ip:port/PROTO" frontends to their decided backends.
func decidedBackends(r topology.Report) map[string][]string {
	out := map[string][]string{}
	for _, s := range r.Services {
		for i, fe := range s.Frontends {
			bes := s.Backends
			if i > 0 {
				bes = s.ExternalBackends
			}
			if s.Protocol == "TCP" || s.Protocol == "UDP" {
				out[fe+"/"+s.Protocol] = bes
			}
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
