package main

import (
	"cmp"
	"fmt"
	"io"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"

	dpmaps "github.com/topolb/topolb/maps"
)

func init() {
	extraCommands = append(extraCommands, newMapsCommand)
}

// mapsFlags are the flags every `maps` subcommand takes.
type mapsFlags struct {
	bpffs, output string
	filter        rowFilter
}

// newMapsCommand is `topolbctl maps`: the pinned maps read and decoded
// by maps.Pinned, presented here.
func newMapsCommand() *cobra.Command {
	var f mapsFlags
	cmd := &cobra.Command{
		Use:   "maps frontends|backends|conntrack|snat|affinity|stats --bpffs DIR",
		Short: "Read the datapath's pinned maps, decoded, without the agent",
		Long: `maps reads the maps pinned under --bpffs straight from the kernel and
decodes them: addresses and ports in their usual notation, states and
counters by name, frontends named by the Service port the agent recorded
for them. It opens the maps read-only and takes no lock: it works beside
the running agent and while no agent runs (the datapath keeps serving).
Needs root (CAP_BPF).

  frontends  every frontend: its service, id, slots, backends, settings
  backends   one row per backend of a frontend: state, weight, counters
  conntrack  both directions of every flow in both tables (established,
             unreplied): the addresses as they arrive and as translated,
             state, time left, backend and service
  snat       the node's source ports held by source-translated flows
  affinity   session-affinity memories: client, frontend, backend, time left
  stats      every datapath counter

Filters narrow the rows: --address (an IP or a CIDR, matched against every
address of a row), --port (any port of a row), --protocol, --state,
--service. -o json and -o yaml print the same rows as structured data.`,
		Example: `  topolbctl maps frontends
  topolbctl maps backends --service default/web --state draining
  topolbctl maps conntrack --address 10.96.0.10 --port 80 --state established -o json
  topolbctl maps snat --bpffs /sys/fs/bpf/topolb/node-b1`,
		Args: cobra.NoArgs,
	}
	cmd.PersistentFlags().StringVar(&f.bpffs, "bpffs", dpmaps.DefaultPinPath, "the agent's pin directory (its --bpffs)")
	cmd.PersistentFlags().StringVarP(&f.output, "output", "o", "table", "output format: table, json or yaml")
	for _, sub := range []struct {
		name, short, states string
		print               func(w io.Writer, p *dpmaps.Pinned, f mapsFlags) error
	}{
		{"frontends", "List the frontends: service, id, slots, backends and settings", "", printPinnedFrontends},
		{"backends", "List every frontend's backends with state, weight and counters", "active, draining", printPinnedBackends},
		{"conntrack", "List both conntrack tables: both address pairs, state, expiry, backend", "syn_sent, established, closing, udp, expired", printConntrack},
		{"snat", "List the source ports held by source-translated flows", "syn_sent, established, closing, udp, expired", printSNAT},
		{"affinity", "List the session-affinity memories", "live, expired, stale (backend gone)", printAffinity},
		{"stats", "List the datapath counters, summed over CPUs", "", printPinnedStats},
	} {
		sub := sub
		c := &cobra.Command{
			Use:   sub.name,
			Short: sub.short,
			Args:  cobra.NoArgs,
			RunE: func(cmd *cobra.Command, _ []string) error {
				if f.output != "table" && f.output != "json" && f.output != "yaml" {
					return usageError(fmt.Errorf("-o %q: want table, json or yaml", f.output))
				}
				if err := f.filter.parse(); err != nil {
					return usageError(err)
				}
				p, err := dpmaps.OpenPinned(f.bpffs)
				if err != nil {
					return err
				}
				defer p.Close()
				return sub.print(cmd.OutOrStdout(), p, f)
			},
		}
		if sub.name != "stats" {
			f.filter.addFlags(c, sub.states)
		}
		cmd.AddCommand(c)
	}
	return cmd
}

// rowFilter selects rows by their addresses, ports, protocol, state and
// service; a zero field selects everything.
type rowFilter struct {
	address, protocol, state, service string
	port                              uint16

	prefix netip.Prefix
	proto  dpmaps.Protocol
}

func (f *rowFilter) addFlags(cmd *cobra.Command, states string) {
	cmd.Flags().StringVar(&f.address, "address", "", "only rows with this IP address, or one inside this CIDR, among their addresses")
	cmd.Flags().Uint16Var(&f.port, "port", 0, "only rows with this port among their addresses' ports")
	cmd.Flags().StringVar(&f.protocol, "protocol", "", "only rows of this protocol: TCP or UDP")
	cmd.Flags().StringVar(&f.service, "service", "", `only rows of this service: "namespace/name" or "namespace/name:port", as the agent recorded it`)
	if states != "" {
		cmd.Flags().StringVar(&f.state, "state", "", "only rows in this state: "+states)
	}
}

// parse checks the filter's flags.
func (f *rowFilter) parse() error {
	switch strings.ToUpper(f.protocol) {
	case "":
	case "TCP":
		f.proto = dpmaps.TCP
	case "UDP":
		f.proto = dpmaps.UDP
	default:
		return fmt.Errorf("--protocol %q: want TCP or UDP", f.protocol)
	}
	if f.address == "" {
		return nil
	}
	var err error
	if strings.Contains(f.address, "/") {
		f.prefix, err = netip.ParsePrefix(f.address)
	} else {
		var a netip.Addr
		if a, err = netip.ParseAddr(f.address); err == nil {
			f.prefix = netip.PrefixFrom(a, a.BitLen())
		}
	}
	if err != nil {
		return fmt.Errorf("--address %q: want an IP address or a CIDR: %w", f.address, err)
	}
	f.prefix = f.prefix.Masked()
	return nil
}

// match reports whether a row with these addresses, protocol, state and
// service name passes the filter. A service filter without a port
// matches every port of the Service.
func (f *rowFilter) match(addrs []netip.AddrPort, proto dpmaps.Protocol, state, name string) bool {
	if f.proto != 0 && proto != f.proto || f.state != "" && !strings.EqualFold(state, f.state) {
		return false
	}
	if f.service != "" && name != f.service && !strings.HasPrefix(name, f.service+":") {
		return false
	}
	if f.prefix.IsValid() && !slices.ContainsFunc(addrs, func(a netip.AddrPort) bool { return f.prefix.Contains(a.Addr()) }) {
		return false
	}
	return f.port == 0 || slices.ContainsFunc(addrs, func(a netip.AddrPort) bool { return a.Port() == f.port })
}

// pinnedFrontend is one frontend as `maps frontends` prints it.
type pinnedFrontend struct {
	Frontend               string   `json:"frontend"`
	Service                string   `json:"service,omitempty"`
	ID                     uint32   `json:"id"`
	Slots                  uint32   `json:"slots"`
	Backends               []string `json:"backends"`
	DrainingBackends       []string `json:"drainingBackends"`
	AffinityTimeoutSeconds int64    `json:"affinityTimeoutSeconds,omitempty"`
	Reject                 bool     `json:"reject,omitempty"`
	SourceRanges           []string `json:"sourceRanges,omitempty"`
	// Problems are inconsistencies found in the maps (docs/datapath.md).
	Problems []string `json:"problems,omitempty"`
}

func printPinnedFrontends(w io.Writer, p *dpmaps.Pinned, f mapsFlags) error {
	fes, err := p.Frontends()
	if err != nil {
		return err
	}
	out := []pinnedFrontend{}
	for _, fe := range fes {
		if !f.filter.match([]netip.AddrPort{fe.Frontend.Addr}, fe.Frontend.Proto, "", fe.Name) {
			continue
		}
		r := pinnedFrontend{Frontend: fe.Frontend.String(), Service: fe.Name, ID: fe.ID, Slots: fe.Slots,
			Backends: []string{}, DrainingBackends: []string{}, AffinityTimeoutSeconds: int64(fe.Affinity / time.Second),
			Reject: fe.Reject, Problems: fe.Problems}
		for _, b := range fe.Backends {
			if b.Draining {
				r.DrainingBackends = append(r.DrainingBackends, b.Addr.String())
			} else {
				r.Backends = append(r.Backends, b.Addr.String())
			}
		}
		for _, sr := range fe.SourceRanges {
			r.SourceRanges = append(r.SourceRanges, sr.String())
		}
		out = append(out, r)
	}
	return present(w, f.output, out, "FRONTEND\tSERVICE\tID\tSLOTS\tBACKENDS\tDRAINING\tSETTINGS", func(r pinnedFrontend) []string {
		settings := []string{}
		if r.AffinityTimeoutSeconds > 0 {
			settings = append(settings, fmt.Sprintf("affinity %ds", r.AffinityTimeoutSeconds))
		}
		if r.Reject {
			settings = append(settings, "reject")
		}
		if r.SourceRanges != nil {
			settings = append(settings, "ranges "+strings.Join(r.SourceRanges, ","))
		}
		if len(r.Problems) > 0 {
			settings = append(settings, fmt.Sprintf("PROBLEMS: %s", strings.Join(r.Problems, "; ")))
		}
		return []string{r.Frontend, orDash(cell(r.Service, maxName)), fmt.Sprint(r.ID), fmt.Sprint(r.Slots),
			orDash(strings.Join(r.Backends, " ")), fmt.Sprint(len(r.DrainingBackends)), orDash(cell(strings.Join(settings, ", "), maxText))}
	})
}

// pinnedBackend is one backend of a frontend as `maps backends` prints it.
type pinnedBackend struct {
	Frontend string `json:"frontend"`
	Service  string `json:"service,omitempty"`
	Backend  string `json:"backend"`
	// State is the registry's: active or draining.
	State string `json:"state"`
	// Weight is the slots the backend holds (0 when draining).
	Weight    uint32 `json:"weight"`
	NodeLocal bool   `json:"nodeLocal,omitempty"`
	ZoneLocal bool   `json:"zoneLocal,omitempty"`
	ID        uint32 `json:"id"`
	Flows     uint64 `json:"flows"`
	Packets   uint64 `json:"packets"`
	Bytes     uint64 `json:"bytes"`
}

func printPinnedBackends(w io.Writer, p *dpmaps.Pinned, f mapsFlags) error {
	fes, err := p.Frontends()
	if err != nil {
		return err
	}
	out := []pinnedBackend{}
	for _, fe := range fes {
		for _, b := range fe.Backends {
			if !f.filter.match([]netip.AddrPort{fe.Frontend.Addr, b.Addr}, fe.Frontend.Proto, b.State, fe.Name) {
				continue
			}
			out = append(out, pinnedBackend{Frontend: fe.Frontend.String(), Service: fe.Name, Backend: b.Addr.String(), State: b.State,
				Weight: b.Weight, NodeLocal: b.NodeLocal, ZoneLocal: b.ZoneLocal, ID: b.ID,
				Flows: b.Traffic.Flows, Packets: b.Traffic.Packets, Bytes: b.Traffic.Bytes})
		}
	}
	return present(w, f.output, out, "FRONTEND\tSERVICE\tBACKEND\tSTATE\tWEIGHT\tLOCAL\tFLOWS\tPACKETS\tBYTES", func(r pinnedBackend) []string {
		local := []string{}
		if r.NodeLocal {
			local = append(local, "node")
		}
		if r.ZoneLocal {
			local = append(local, "zone")
		}
		return []string{r.Frontend, orDash(cell(r.Service, maxName)), r.Backend, r.State, fmt.Sprint(r.Weight),
			orDash(strings.Join(local, ",")), fmt.Sprint(r.Flows), fmt.Sprint(r.Packets), fmt.Sprint(r.Bytes)}
	})
}

// conntrackRow is one conntrack entry as `maps conntrack` prints it.
type conntrackRow struct {
	Table     string `json:"table"`
	Protocol  string `json:"protocol"`
	Direction string `json:"direction"`
	// Src and Dst as the packet arrives, NewSrc and NewDst as translated.
	Src    string `json:"src"`
	Dst    string `json:"dst"`
	NewSrc string `json:"newSrc"`
	NewDst string `json:"newDst"`
	State  string `json:"state"`
	SNAT   bool   `json:"snat,omitempty"`
	// ExpiresSeconds is the time left; not above 0: expired.
	ExpiresSeconds float64 `json:"expiresSeconds"`
	Frontend       string  `json:"frontend,omitempty"`
	Service        string  `json:"service,omitempty"`
	Backend        string  `json:"backend"`
	// BackendGone says the backend's id was released: the flow is
	// re-balanced on its next packet.
	BackendGone bool   `json:"backendGone,omitempty"`
	Redirect    string `json:"redirect"`
}

// flowState is a row's state for --state: "expired" once expired.
func flowState(state string, left time.Duration) string {
	if left <= 0 {
		return "expired"
	}
	return state
}

func printConntrack(w io.Writer, p *dpmaps.Pinned, f mapsFlags) error {
	entries, err := p.Conntrack()
	if err != nil {
		return err
	}
	out := []conntrackRow{}
	for _, e := range entries {
		if !f.filter.match([]netip.AddrPort{e.Src, e.Dst, e.NewSrc, e.NewDst}, e.Proto, flowState(e.State, e.Expires), e.Name) {
			continue
		}
		out = append(out, conntrackRow{Table: e.Table, Protocol: e.Proto.String(), Direction: e.Direction,
			Src: e.Src.String(), Dst: e.Dst.String(), NewSrc: e.NewSrc.String(), NewDst: e.NewDst.String(),
			State: e.State, SNAT: e.SNAT, ExpiresSeconds: e.Expires.Seconds(), Frontend: frontendName(e.Frontend), Service: e.Name,
			Backend: e.Backend.Addr.String(), BackendGone: !e.Backend.Current, Redirect: e.Redirect})
	}
	return present(w, f.output, out, "TABLE\tPROTO\tDIR\tARRIVES\tTRANSLATED\tSTATE\tEXPIRES\tBACKEND\tSERVICE", func(r conntrackRow) []string {
		backend := r.Backend
		if r.BackendGone {
			backend += " (gone)"
		}
		state := r.State
		if r.SNAT {
			state += ",snat"
		}
		return []string{r.Table, r.Protocol, r.Direction, r.Src + " > " + r.Dst, r.NewSrc + " > " + r.NewDst, state,
			expires(r.ExpiresSeconds), backend, orDash(cell(r.Service, maxName))}
	})
}

// snatRow is one SNAT port in use as `maps snat` prints it.
type snatRow struct {
	Backend        string  `json:"backend"`
	Protocol       string  `json:"protocol"`
	Node           string  `json:"node"`
	Client         string  `json:"client"`
	Frontend       string  `json:"frontend,omitempty"`
	Service        string  `json:"service,omitempty"`
	State          string  `json:"state"`
	ExpiresSeconds float64 `json:"expiresSeconds"`
}

func printSNAT(w io.Writer, p *dpmaps.Pinned, f mapsFlags) error {
	entries, err := p.Conntrack()
	if err != nil {
		return err
	}
	out := []snatRow{}
	perBackend := map[string]int{}
	for _, s := range dpmaps.SNATPorts(entries) {
		if !f.filter.match([]netip.AddrPort{s.Node, s.Backend, s.Client, s.Frontend.Addr}, s.Proto, flowState(s.State, s.Expires), s.Name) {
			continue
		}
		out = append(out, snatRow{Backend: s.Backend.String(), Protocol: s.Proto.String(), Node: s.Node.String(), Client: s.Client.String(),
			Frontend: frontendName(s.Frontend), Service: s.Name, State: s.State, ExpiresSeconds: s.Expires.Seconds()})
		if s.Expires > 0 {
			perBackend[s.Backend.String()]++
		}
	}
	if err := present(w, f.output, out, "BACKEND\tPROTO\tNODE PORT\tCLIENT\tSERVICE\tSTATE\tEXPIRES", func(r snatRow) []string {
		return []string{r.Backend, r.Protocol, r.Node, r.Client, orDash(cell(r.Service, maxName)), r.State, expires(r.ExpiresSeconds)}
	}); err != nil || f.output != "table" || len(out) == 0 {
		return err
	}
	backends := make([]string, 0, len(perBackend))
	for b := range perBackend {
		backends = append(backends, b)
	}
	slices.SortFunc(backends, func(a, b string) int { return cmp.Or(cmp.Compare(perBackend[b], perBackend[a]), cmp.Compare(a, b)) })
	live := 0
	for i, b := range backends {
		live += perBackend[b]
		backends[i] = fmt.Sprintf("%s %d", b, perBackend[b])
	}
	_, err = fmt.Fprintf(w, "\n%d ports held by live flows (each backend has the whole --snat-ports range)%s\n", live, prefixed(": ", strings.Join(backends, ", ")))
	return err
}

// affinityRow is one affinity memory as `maps affinity` prints it.
type affinityRow struct {
	Client   string `json:"client"`
	Frontend string `json:"frontend,omitempty"`
	Service  string `json:"service,omitempty"`
	// Backend is empty when its id was released: the memory is ignored.
	Backend        string  `json:"backend,omitempty"`
	ExpiresSeconds float64 `json:"expiresSeconds"`
}

func printAffinity(w io.Writer, p *dpmaps.Pinned, f mapsFlags) error {
	entries, err := p.Affinity()
	if err != nil {
		return err
	}
	out := []affinityRow{}
	for _, e := range entries {
		state := flowState("live", e.Expires)
		if !e.Backend.Current {
			state = "stale"
		}
		addrs := []netip.AddrPort{netip.AddrPortFrom(e.Client, 0), e.Frontend.Addr}
		if e.Backend.Current {
			addrs = append(addrs, e.Backend.Addr)
		}
		if !f.filter.match(addrs, e.Frontend.Proto, state, e.Name) {
			continue
		}
		r := affinityRow{Client: e.Client.String(), Frontend: frontendName(e.Frontend), Service: e.Name, ExpiresSeconds: e.Expires.Seconds()}
		if e.Backend.Current {
			r.Backend = e.Backend.Addr.String()
		}
		out = append(out, r)
	}
	return present(w, f.output, out, "CLIENT\tFRONTEND\tSERVICE\tBACKEND\tEXPIRES", func(r affinityRow) []string {
		return []string{r.Client, orDash(r.Frontend), orDash(cell(r.Service, maxName)), orDash(r.Backend), expires(r.ExpiresSeconds)}
	})
}

// statRow is one counter as `maps stats` prints it.
type statRow struct {
	Counter string `json:"counter"`
	Value   uint64 `json:"value"`
}

func printPinnedStats(w io.Writer, p *dpmaps.Pinned, f mapsFlags) error {
	st, err := p.Stats()
	if err != nil {
		return err
	}
	out := make([]statRow, 0, len(st))
	for s, v := range st {
		out = append(out, statRow{Counter: s.String(), Value: v})
	}
	slices.SortFunc(out, func(a, b statRow) int { return cmp.Compare(a.Counter, b.Counter) })
	return present(w, f.output, out, "COUNTER\tVALUE", func(r statRow) []string { return []string{r.Counter, fmt.Sprint(r.Value)} })
}

// frontendName is fe's string, "" for the zero Frontend (a service id no
// longer programmed).
func frontendName(fe dpmaps.Frontend) string {
	if !fe.Addr.IsValid() {
		return ""
	}
	return fe.String()
}

// expires formats a time left: "12s", or "expired".
func expires(seconds float64) string {
	if seconds <= 0 {
		return "expired"
	}
	return (time.Duration(seconds * float64(time.Second))).Round(time.Second).String()
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func prefixed(prefix, s string) string {
	if s == "" {
		return ""
	}
	return prefix + s
}

// present prints out as JSON or YAML, or as a table of header
// (tab-separated) and a row of each (with none, "no entries").
func present[T any](w io.Writer, output string, out []T, header string, row func(T) []string) error {
	if output != "table" {
		return printStructured(w, out, output)
	}
	if len(out) == 0 {
		_, err := fmt.Fprintln(w, "no entries")
		return err
	}
	rows := make([][]string, len(out))
	for i, r := range out {
		rows[i] = row(r)
	}
	return writeTable(w, header, rows)
}
