package testbed

import (
	"bufio"
	"bytes"
	"fmt"
	"net"
	"net/netip"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// This file reads what kube-proxy programmed, frontend by frontend, from
// its ruleset: `nft list table ip kube-proxy` (nftables mode) or
// `iptables-save` (iptables mode). It does not trust names or comments: it
// starts where packets enter (the service-ips and service-nodeports maps;
// the KUBE-SERVICES and KUBE-NODEPORTS chains), follows every jump and goto
// that a packet from a given source address can take, and collects the
// DNAT destinations it reaches. A frontend kube-proxy rejects or drops
// (no endpoints, or no local endpoints) is present with no endpoints.

// FrontendKey names a frontend the way topolb's /debug/state does:
// "ip:port/PROTO".
func FrontendKey(a netip.AddrPort, proto string) string {
	return a.String() + "/" + strings.ToUpper(proto)
}

// ruleMatch is what a rule's conditions say about a packet from one
// source: it never matches, it matches for certain, or it may match
// (random choices, marks, anything this reader does not evaluate).
type ruleMatch int

const (
	matchNever ruleMatch = iota
	matchMaybe
	matchAlways
)

// sourceCond evaluates a source-address condition: a prefix (or address)
// the source must, or with negate must not, be in.
func sourceCond(from netip.Addr, prefix string, negate bool) (ruleMatch, error) {
	p, err := netip.ParsePrefix(prefix)
	if err != nil {
		a, aerr := netip.ParseAddr(prefix)
		if aerr != nil {
			return matchMaybe, fmt.Errorf("source condition %q: %w", prefix, err)
		}
		p = netip.PrefixFrom(a, a.BitLen())
	}
	if p.Contains(from) != negate {
		return matchAlways, nil
	}
	return matchNever, nil
}

// and combines two conditions of one rule.
func (m ruleMatch) and(o ruleMatch) ruleMatch { return min(m, o) }

// ruleGraph is a ruleset reduced to what the walk needs: per chain, its
// rules in order.
type ruleGraph struct {
	chains map[string][]rule
}

// rule is one rule: how it matches a given source, and what it does.
type rule struct {
	match func(from netip.Addr) (ruleMatch, error)
	// targets are the chains it jumps or goes to (several for a verdict
	// map), dnat the destinations it translates to.
	targets []string
	dnat    []string
	// final is set when a match ends the walk of this chain: a goto, a
	// DNAT, or a drop/reject/return verdict.
	final bool
}

// endpoints returns the DNAT destinations a packet from `from` can reach
// from chain, sorted and without repeats.
func (g *ruleGraph) endpoints(chain string, from netip.Addr) ([]string, error) {
	var out []string
	seen := map[string]bool{}
	var walk func(string, int) error
	walk = func(name string, depth int) error {
		if depth > 32 {
			return fmt.Errorf("chain %s: jumps nest deeper than 32", name)
		}
		rules, ok := g.chains[name]
		if !ok {
			return fmt.Errorf("jump to chain %s, which the ruleset does not have", name)
		}
		if seen[name] {
			return nil
		}
		seen[name] = true
		defer delete(seen, name)
		for _, r := range rules {
			m, err := r.match(from)
			if err != nil {
				return fmt.Errorf("chain %s: %w", name, err)
			}
			if m == matchNever {
				continue
			}
			out = append(out, r.dnat...)
			for _, t := range r.targets {
				if err := walk(t, depth+1); err != nil {
					return err
				}
			}
			if m == matchAlways && r.final {
				return nil
			}
		}
		return nil
	}
	if err := walk(chain, 0); err != nil {
		return nil, err
	}
	if out == nil {
		return []string{}, nil
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

// ---- nftables ----

// nftAddrRE matches an address as nft prints it in either family's table:
// dotted IPv4, or IPv6 (hex groups and colons; chain names, ports and
// verdicts never hold a colon next to a hex digit).
const nftAddrRE = `(?:\d+\.\d+\.\d+\.\d+|[0-9a-f]*:[0-9a-f:]+)`

var (
	nftChainStart = regexp.MustCompile(`^\s*chain (\S+) \{`)
	nftMapStart   = regexp.MustCompile(`^\s*(?:map|set) (\S+) \{`)
	// An element of service-ips or no-endpoint-services:
	// "10.96.0.10 . tcp . 80 comment "..." : goto chain".
	nftIPElement = regexp.MustCompile(`(` + nftAddrRE + `) \. (tcp|udp|sctp) \. (\d+)(?: comment "[^"]*")? : (goto|jump|drop|reject) ?([^\s,}]*)`)
	// An element of service-nodeports or no-endpoint-nodeports:
	// "tcp . 30080 : goto chain".
	nftPortElement = regexp.MustCompile(`(?:^|[{,]\s*)(tcp|udp|sctp) \. (\d+)(?: comment "[^"]*")? : (goto|jump|drop|reject) ?([^\s,}]*)`)
	nftAddr        = regexp.MustCompile(nftAddrRE + `(?:/\d+)?`)
	nftSaddr       = regexp.MustCompile(`\bip6? saddr (!= )?(` + nftAddrRE + `(?:/\d+)?)`)
	nftJump        = regexp.MustCompile(`\b(jump|goto) ([^\s,}]+)`)
	nftDNATMap     = regexp.MustCompile(`(` + nftAddrRE + `) \. (\d+)`)
	// "dnat to 10.244.1.3:8080", "dnat to [fd00:10:244:1::3]:8080".
	nftDNATOne = regexp.MustCompile(`\bdnat (?:ip6? )?to (\d+\.\d+\.\d+\.\d+:\d+|\[[0-9a-f:]+\]:\d+)`)
	// nftNeutral are conditions every packet of a frontend meets: its
	// protocol and destination, which the map lookup already fixed.
	nftNeutral = regexp.MustCompile(`meta l4proto (tcp|udp|sctp)|ip6? daddr \S+|th dport \d+|(tcp|udp) dport \d+|comment "[^"]*"`)
)

// nftParsed is the part of an nftables ruleset the reader uses: chains,
// and the elements of the maps and sets by name.
type nftParsed struct {
	graph ruleGraph
	sets  map[string][]string
}

// parseNFT splits `nft list table ip kube-proxy` into chains (one rule a
// line) and map/set bodies (elements may span lines).
func parseNFT(ruleset []byte) (*nftParsed, error) {
	p := &nftParsed{graph: ruleGraph{chains: map[string][]rule{}}, sets: map[string][]string{}}
	sc := bufio.NewScanner(bytes.NewReader(ruleset))
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	var chain, set string
	for sc.Scan() {
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		switch {
		case chain == "" && set == "":
			if m := nftChainStart.FindStringSubmatch(line); m != nil {
				chain = m[1]
				p.graph.chains[chain] = nil
			} else if m := nftMapStart.FindStringSubmatch(line); m != nil {
				set = m[1]
			}
		case trimmed == "}":
			chain, set = "", ""
		case set != "":
			p.sets[set] = append(p.sets[set], trimmed)
		case strings.HasPrefix(trimmed, "type ") || strings.HasPrefix(trimmed, "comment ") || trimmed == "":
			// A base chain's hook line, or the chain's comment.
		default:
			p.graph.chains[chain] = append(p.graph.chains[chain], nftRule(trimmed))
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read nft ruleset: %w", err)
	}
	return p, nil
}

// nftRule reads one rule line of a chain.
func nftRule(line string) rule {
	// Everything before the first statement that acts is a condition.
	act := len(line)
	for _, kw := range []string{"jump ", "goto ", "dnat ", "drop", "reject", "return", "numgen ", "masquerade", "meta mark set", "counter"} {
		if i := strings.Index(line, kw); i >= 0 && i < act {
			act = i
		}
	}
	cond := line[:act]
	r := rule{}
	for _, m := range nftJump.FindAllStringSubmatch(line, -1) {
		r.targets = append(r.targets, m[2])
		if m[1] == "goto" && !strings.Contains(line, "vmap") {
			r.final = true
		}
	}
	if strings.Contains(line, "dnat ") {
		r.final = true
		if m := nftDNATOne.FindStringSubmatch(line); m != nil {
			r.dnat = append(r.dnat, m[1])
		} else if _, after, ok := strings.Cut(line, " map {"); ok {
			for _, m := range nftDNATMap.FindAllStringSubmatch(after, -1) {
				// "ip:port" as netip prints it: IPv6 in brackets.
				r.dnat = append(r.dnat, net.JoinHostPort(m[1], m[2]))
			}
		}
	}
	for _, v := range []string{"drop", "reject", "return"} {
		if strings.HasSuffix(strings.TrimSpace(line), v) {
			r.final = true
		}
	}
	saddrs := nftSaddr.FindAllStringSubmatch(cond, -1)
	fibLocal := strings.Contains(cond, "fib saddr type local")
	// Conditions other than the source's (marks, connection state,
	// addresses of the destination, which the frontend already fixed)
	// are not evaluated: they make the rule a "maybe", except the
	// protocol and destination checks that every frontend's path has.
	rest := nftSaddr.ReplaceAllString(cond, "")
	rest = strings.ReplaceAll(rest, "fib saddr type local", "")
	rest = nftNeutral.ReplaceAllString(rest, "")
	others := strings.TrimSpace(rest) != ""
	r.match = func(from netip.Addr) (ruleMatch, error) {
		m := matchAlways
		if others {
			m = matchMaybe
		}
		if fibLocal {
			// The sources this reader evaluates (pods, clients outside
			// the node) are never the node's own addresses.
			return matchNever, nil
		}
		for _, s := range saddrs {
			c, err := sourceCond(from, s[2], s[1] != "")
			if err != nil {
				return matchMaybe, err
			}
			m = m.and(c)
		}
		return m, nil
	}
	return r
}

// nftFrontends reads, for a packet from `from`, the endpoints of every
// frontend kube-proxy programmed in nftables mode, by FrontendKey.
func nftFrontends(ruleset []byte, from netip.Addr) (map[string][]string, error) {
	p, err := parseNFT(ruleset)
	if err != nil {
		return nil, err
	}
	out := map[string][]string{}
	// add records a frontend of a map. The no-endpoint maps are read
	// last: their drop or reject applies only to packets the NAT maps did
	// not translate (kube-proxy checks them in filter chains, after DNAT),
	// so a frontend some path translates keeps those endpoints.
	add := func(key, verdict, target string) error {
		if verdict != "goto" && verdict != "jump" {
			if _, ok := out[key]; !ok {
				out[key] = []string{}
			}
			return nil
		}
		eps, err := p.graph.endpoints(target, from)
		if err != nil {
			return fmt.Errorf("frontend %s: %w", key, err)
		}
		if len(eps) > 0 || out[key] == nil {
			out[key] = eps
		}
		return nil
	}
	for _, set := range []string{"service-ips", "no-endpoint-services"} {
		for _, m := range nftIPElement.FindAllStringSubmatch(strings.Join(p.sets[set], " "), -1) {
			port, _ := strconv.ParseUint(m[3], 10, 16)
			key := FrontendKey(netip.AddrPortFrom(netip.MustParseAddr(m[1]), uint16(port)), m[2])
			if err := add(key, m[4], m[5]); err != nil {
				return nil, err
			}
		}
	}
	var nodeIPs []netip.Addr
	for _, a := range nftAddr.FindAllString(strings.Join(p.sets["nodeport-ips"], " "), -1) {
		if ip, err := netip.ParseAddr(a); err == nil {
			nodeIPs = append(nodeIPs, ip)
		}
	}
	for _, set := range []string{"service-nodeports", "no-endpoint-nodeports"} {
		for _, m := range nftPortElement.FindAllStringSubmatch(strings.Join(p.sets[set], " "), -1) {
			port, _ := strconv.ParseUint(m[2], 10, 16)
			for _, ip := range nodeIPs {
				if err := add(FrontendKey(netip.AddrPortFrom(ip, uint16(port)), m[1]), m[3], m[4]); err != nil {
					return nil, err
				}
			}
		}
	}
	return out, nil
}

// ---- iptables ----

// iptablesSave is an iptables-save dump: per table, per chain, the rules'
// arguments after "-A CHAIN".
type iptablesSave map[string]map[string][][]string

func parseIPTablesSave(save []byte) (iptablesSave, error) {
	out := iptablesSave{}
	var table string
	sc := bufio.NewScanner(bytes.NewReader(save))
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "*"):
			table = line[1:]
			out[table] = map[string][][]string{}
		case strings.HasPrefix(line, ":"):
			name, _, _ := strings.Cut(line[1:], " ")
			out[table][name] = nil
		case strings.HasPrefix(line, "-A "):
			args, err := splitArgs(line[3:])
			if err != nil {
				return nil, err
			}
			if len(args) == 0 || table == "" {
				return nil, fmt.Errorf("iptables-save line %q outside a table", line)
			}
			out[table][args[0]] = append(out[table][args[0]], args[1:])
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read iptables-save: %w", err)
	}
	return out, nil
}

// splitArgs splits an iptables-save rule into arguments; double quotes
// group (comments), backslash escapes inside them.
func splitArgs(s string) ([]string, error) {
	var out []string
	var cur strings.Builder
	in, quoted := false, false
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case quoted && c == '\\' && i+1 < len(s):
			i++
			cur.WriteByte(s[i])
		case c == '"':
			quoted, in = !quoted, true
		case c == ' ' && !quoted:
			if in {
				out = append(out, cur.String())
				cur.Reset()
				in = false
			}
		default:
			cur.WriteByte(c)
			in = true
		}
	}
	if quoted {
		return nil, fmt.Errorf("unbalanced quote in %q", s)
	}
	if in {
		out = append(out, cur.String())
	}
	return out, nil
}

// iptArgs is one rule's arguments with the options this reader uses.
type iptArgs struct {
	jump, gotoChain string
	dnat            string
	src, dst        string
	srcNeg          bool
	srcLocal        int // 0: no condition, 1: --src-type LOCAL, -1: ! --src-type LOCAL
	dstLocal        bool
	proto, dport    string
	// others is set when the rule has a condition this reader does not
	// evaluate (random choice, marks, connection state).
	others bool
}

func readIPTArgs(a []string) iptArgs {
	var r iptArgs
	neg := false
	for i := 0; i < len(a); i++ {
		next := func() string {
			if i+1 < len(a) {
				i++
				return a[i]
			}
			return ""
		}
		switch a[i] {
		case "!":
			neg = true
			continue
		case "-j":
			r.jump = next()
		case "-g":
			r.gotoChain = next()
		case "--to-destination":
			r.dnat = next()
		case "-s":
			r.src, r.srcNeg = next(), neg
		case "-d":
			r.dst = next()
		case "-p":
			r.proto = next()
		case "--dport":
			r.dport = next()
		case "--src-type":
			if next() == "LOCAL" {
				r.srcLocal = 1
				if neg {
					r.srcLocal = -1
				}
			}
		case "--dst-type":
			r.dstLocal = next() == "LOCAL" && !neg
		case "-m":
			switch next() {
			case "comment", "tcp", "udp", "sctp", "addrtype":
			default:
				r.others = true
			}
		case "--comment", "--reject-with", "--mode", "--probability", "--nfacct-name", "--ctstate", "--mark", "--set-xmark", "--random-fully", "--log-prefix":
			next()
		}
		neg = false
	}
	return r
}

func (r iptArgs) match(from netip.Addr) (ruleMatch, error) {
	m := matchAlways
	if r.others {
		m = matchMaybe
	}
	if r.srcLocal == 1 {
		return matchNever, nil
	}
	if r.src != "" {
		c, err := sourceCond(from, r.src, r.srcNeg)
		if err != nil {
			return matchMaybe, err
		}
		m = m.and(c)
	}
	return m, nil
}

// natGraph turns the nat table into a rule graph.
func natGraph(nat map[string][][]string) ruleGraph {
	g := ruleGraph{chains: map[string][]rule{}}
	for name, rules := range nat {
		g.chains[name] = nil
		for _, args := range rules {
			a := readIPTArgs(args)
			r := rule{match: a.match}
			switch {
			case a.gotoChain != "":
				r.targets, r.final = []string{a.gotoChain}, true
			case a.jump == "DNAT":
				r.dnat, r.final = []string{a.dnat}, true
			case a.jump == "RETURN" || a.jump == "DROP" || a.jump == "REJECT":
				r.final = true
			case a.jump != "":
				if _, user := nat[a.jump]; user {
					r.targets = []string{a.jump}
				}
			}
			g.chains[name] = append(g.chains[name], r)
		}
	}
	return g
}

// iptFrontends reads, for a packet from `from`, the endpoints of every
// frontend kube-proxy programmed in iptables mode, by FrontendKey.
func iptFrontends(save []byte, from netip.Addr) (map[string][]string, error) {
	tables, err := parseIPTablesSave(save)
	if err != nil {
		return nil, err
	}
	nat := tables["nat"]
	g := natGraph(nat)
	out := map[string][]string{}
	var nodeIPs []netip.Addr
	frontend := func(dst, proto, dport string) (string, error) {
		ip, err := netip.ParsePrefix(dst)
		if err != nil {
			return "", fmt.Errorf("destination %q: %w", dst, err)
		}
		port, err := strconv.ParseUint(dport, 10, 16)
		if err != nil {
			return "", fmt.Errorf("port %q: %w", dport, err)
		}
		return FrontendKey(netip.AddrPortFrom(ip.Addr(), uint16(port)), proto), nil
	}
	// translate records the endpoints a frontend's chain leads to.
	translate := func(dst, proto, dport, chain string) error {
		key, err := frontend(dst, proto, dport)
		if err != nil {
			return err
		}
		eps, err := g.endpoints(chain, from)
		if err != nil {
			return fmt.Errorf("frontend %s: %w", key, err)
		}
		out[key] = eps
		return nil
	}
	for _, args := range nat["KUBE-SERVICES"] {
		a := readIPTArgs(args)
		switch {
		case a.jump == "KUBE-NODEPORTS":
			if p, err := netip.ParsePrefix(a.dst); err == nil {
				nodeIPs = append(nodeIPs, p.Addr())
			}
		case a.dst != "" && a.dport != "" && a.jump != "":
			if err := translate(a.dst, a.proto, a.dport, a.jump); err != nil {
				return nil, err
			}
		}
	}
	for _, args := range nat["KUBE-NODEPORTS"] {
		a := readIPTArgs(args)
		if a.dport == "" || a.jump == "" {
			continue
		}
		for _, ip := range nodeIPs {
			if err := translate(ip.String()+"/32", a.proto, a.dport, a.jump); err != nil {
				return nil, err
			}
		}
	}
	// Rejected and dropped frontends (no endpoints, or no local ones) are
	// in the filter table.
	for _, chain := range []string{"KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES"} {
		for _, args := range tables["filter"][chain] {
			a := readIPTArgs(args)
			if (a.jump != "REJECT" && a.jump != "DROP") || a.dport == "" {
				continue
			}
			dsts := []string{a.dst}
			if a.dst == "" && a.dstLocal {
				dsts = nil
				for _, ip := range nodeIPs {
					dsts = append(dsts, ip.String()+"/32")
				}
			}
			for _, d := range dsts {
				key, err := frontend(d, a.proto, a.dport)
				if err != nil {
					return nil, err
				}
				if _, ok := out[key]; !ok {
					out[key] = []string{}
				}
			}
		}
	}
	return out, nil
}
