package maps

import (
	"bytes"
	"fmt"
	"strings"
	"sync"

	"github.com/cilium/ebpf/btf"
)

// Stat is one named datapath counter of tlb_stats (enum stat_reason in
// bpf/consts.h; the values come from BTF).
type Stat uint32

// Datapath counters.
const (
	// StatDropNoBackend: a new flow to a frontend without an active backend.
	StatDropNoBackend = Stat(tcStatReasonSTAT_DROP_NO_BACKEND)
	// StatDropMapFull: the conntrack entries of a new flow could not be stored.
	StatDropMapFull = Stat(tcStatReasonSTAT_DROP_MAP_FULL)
	// StatDropParseError: malformed IPv4, TCP or UDP header.
	StatDropParseError = Stat(tcStatReasonSTAT_DROP_PARSE_ERROR)
	// StatDropRewrite: a tc rewrite helper failed.
	StatDropRewrite = Stat(tcStatReasonSTAT_DROP_REWRITE)
	// StatReverseNAT: replies rewritten back to a service address.
	StatReverseNAT = Stat(tcStatReasonSTAT_REVERSE_NAT)
	// StatFragment: fragments passed untranslated (both families): not to a
	// Service, or a later fragment without its datagram's first (arrived
	// before it, or more than the timeout after).
	StatFragment = Stat(tcStatReasonSTAT_FRAGMENT)
	// StatConntrackCreated: flows created (two conntrack entries each).
	StatConntrackCreated = Stat(tcStatReasonSTAT_CT_CREATED)
	// StatConntrackReplaced: conntrack entries a new flow replaced,
	// deleted or overwritten (expired, backend gone, reopened by a SYN, an
	// expired SNAT port taken over): entries inserted are
	// 2·StatConntrackCreated − StatConntrackReplaced.
	StatConntrackReplaced = Stat(tcStatReasonSTAT_CT_REPLACED)
	// StatConntrackExpired: packets whose flow had expired; balanced anew.
	StatConntrackExpired = Stat(tcStatReasonSTAT_CT_EXPIRED)
	// StatConntrackStaleBackend: packets whose backend is gone (its id was
	// released); re-balanced.
	StatConntrackStaleBackend = Stat(tcStatReasonSTAT_CT_STALE_BACKEND)
	// StatConntrackSYNReopen: SYNs reusing the tuple of a closing flow or
	// of an unanswered handshake to a draining backend; balanced as new
	// flows.
	StatConntrackSYNReopen = Stat(tcStatReasonSTAT_CT_SYN_REOPEN)
	// StatTCPMidflowMiss: TCP packets without SYN to a frontend that had
	// no conntrack entry at all (evicted or swept): a connection silently
	// re-balanced.
	StatTCPMidflowMiss = Stat(tcStatReasonSTAT_TCP_MIDFLOW_MISS)
	// StatAffinityHit: new flows sent to the client's remembered backend.
	StatAffinityHit = Stat(tcStatReasonSTAT_AFFINITY_HIT)
	// StatAffinityNew: new flows of affinity frontends that chose afresh.
	StatAffinityNew = Stat(tcStatReasonSTAT_AFFINITY_NEW)
	// StatReject: new flows to a frontend without an active backend that
	// asked for rejects (Service.Reject), refused: a TCP reset or an ICMP
	// port unreachable sent (tc, XDP), or the connect or sendmsg failed
	// with ECONNREFUSED (socket hooks).
	StatReject = Stat(tcStatReasonSTAT_REJECT)
	// StatConntrackSwept: conntrack entries deleted by SweepConntrack
	// (kept in the kernel so it survives agent restarts).
	StatConntrackSwept = Stat(tcStatReasonSTAT_CT_SWEPT)
	// StatRejectLimited: rejects over the rate limit (RejectRate per
	// second and CPU, bursts of RejectBurst), dropped instead.
	StatRejectLimited = Stat(tcStatReasonSTAT_REJECT_LIMITED)
	// StatICMPTranslated: ICMP errors about a translated flow, translated
	// back so the client sees them about the frontend.
	StatICMPTranslated = Stat(tcStatReasonSTAT_ICMP_XLATE)
	// StatSockTranslated: connects and unconnected UDP sends of the node's
	// own processes sent to a backend by the socket hooks.
	StatSockTranslated = Stat(tcStatReasonSTAT_SOCK_XLATE)
	// StatSockReverseNAT: backend addresses the socket hooks showed as the
	// frontend (recvmsg source, getpeername).
	StatSockReverseNAT = Stat(tcStatReasonSTAT_SOCK_REVNAT)

	// Forwarding after translation (docs/datapath.md). The StatFwd*
	// path counters count flow directions when their flow is created
	// (two per flow), not packets: per-packet counting would cost a map
	// lookup on the hit path. The fallbacks count packets.

	// StatFwdPeer: flow directions delivered into a local pod with
	// bpf_redirect_peer (from XDP through tc_uplink).
	StatFwdPeer = Stat(tcStatReasonSTAT_FWD_PEER)
	// StatFwdNeigh: flow directions sent out of an interface whose next
	// hop the kernel resolves (bpf_redirect_neigh; from XDP through
	// tc_uplink) until the FIB knows its MAC.
	StatFwdNeigh = Stat(tcStatReasonSTAT_FWD_NEIGH)
	// StatFwdL2: flow directions sent out of an uplink with cached MACs
	// (XDP_TX, XDP_REDIRECT, tc bpf_redirect).
	StatFwdL2 = Stat(tcStatReasonSTAT_FWD_L2)
	// StatFwdStack: flow directions handed to the host stack: no route,
	// a local destination, forwarding off, or an interface topolb is not
	// attached to.
	StatFwdStack = Stat(tcStatReasonSTAT_FWD_STACK)
	// StatFwdFallbackMTU: packets larger than their egress interface's
	// MTU, passed to the stack, which answers "fragmentation needed".
	StatFwdFallbackMTU = Stat(tcStatReasonSTAT_FWD_FALLBACK_MTU)
	// StatFwdFallbackTTL: packets whose TTL would expire, passed to the
	// stack, which answers "time exceeded".
	StatFwdFallbackTTL = Stat(tcStatReasonSTAT_FWD_FALLBACK_TTL)
	// StatFwdFallbackMeta: XDP frames for a pod or a next hop to resolve
	// that could not carry metadata to tc_uplink (a driver without XDP
	// metadata): passed to the stack.
	StatFwdFallbackMeta = Stat(tcStatReasonSTAT_FWD_FALLBACK_META)
	// StatSNATFlows: new flows source-NATed to this node (external
	// frontend, backend on another node).
	StatSNATFlows = Stat(tcStatReasonSTAT_SNAT_FLOWS)
	// StatSNATCollision: SNAT ports tried and found taken.
	StatSNATCollision = Stat(tcStatReasonSTAT_SNAT_COLLISION)
	// StatDropSNATExhausted: new flows dropped because SNATRetries ports
	// of their walk were all taken.
	StatDropSNATExhausted = Stat(tcStatReasonSTAT_DROP_SNAT_EXHAUSTED)
	// StatDropSNATNoRoute: new flows dropped because the FIB had no route
	// (or no source address) towards their remote backend.
	StatDropSNATNoRoute = Stat(tcStatReasonSTAT_DROP_SNAT_NO_ROUTE)
	// StatDropSNATFallback: source-NATed packets that could not be
	// forwarded (MTU, TTL, no route any more): dropped, since the stack
	// would take their source, this node's address, for a martian.
	StatDropSNATFallback = Stat(tcStatReasonSTAT_DROP_SNAT_FALLBACK)
	// StatConntrackPromoted: flows moved into the established table
	// (tlb_conntrack): TCP flows whose client answered the backend's
	// reply, UDP flows that got a reply.
	StatConntrackPromoted = Stat(tcStatReasonSTAT_CT_PROMOTED)
	// StatConntrackPromoteFull: promotions refused because the
	// established table was full; the flow goes on from the unreplied
	// table, where a flood may evict it. Raise MaxConntrack.
	StatConntrackPromoteFull = Stat(tcStatReasonSTAT_CT_PROMOTE_FULL)
	// StatDropSourceLimit: new flows dropped because their source had
	// spent its budget of flows not established yet
	// (Options.NewFlowsPerSource).
	StatDropSourceLimit = Stat(tcStatReasonSTAT_DROP_CT_SOURCE_LIMIT)
	// StatConntrackDemoted: closing flows moved from the established
	// table back to the unreplied one.
	StatConntrackDemoted = Stat(tcStatReasonSTAT_CT_DEMOTED)
	// StatConntrackOrphan: forward entries whose reply entry was gone (an
	// eviction from the unreplied table): deleted, and the packet
	// balanced as new. (A reply entry without its forward entry translates
	// its replies without refreshing until it expires.)
	StatConntrackOrphan = Stat(tcStatReasonSTAT_CT_ORPHAN)
	// StatSNATReclaimed: SNAT ports taken over from a flow that had
	// expired (no sweep needed).
	StatSNATReclaimed = Stat(tcStatReasonSTAT_SNAT_RECLAIMED)
	// StatSockRevNATClobbered: a socket's record of which frontend stands
	// for a backend, rewritten to another frontend: one UDP socket that
	// sent to two Services sharing a backend. Its replies from then on
	// show the last frontend it sent to (README, Limits).
	StatSockRevNATClobbered = Stat(tcStatReasonSTAT_SOCK_REVNAT_CLOBBER)
	// StatDropSourceRange: new flows to a frontend with
	// Service.SourceRanges from a source outside them, dropped (or the
	// host process's call refused with EPERM).
	StatDropSourceRange = Stat(tcStatReasonSTAT_DROP_SRC_RANGE)
	// StatFragFirst: first fragments of a datagram translated; their
	// ports remembered for the later fragments.
	StatFragFirst = Stat(tcStatReasonSTAT_FRAG_FIRST)
	// StatFragFollowed: later fragments translated as their datagram's
	// first was.
	StatFragFollowed = Stat(tcStatReasonSTAT_FRAG_FOLLOWED)
	// StatConntrackTCPIgnored: TCP resets and FINs outside their flow's
	// window, and SYNs to an established flow: translated, the flow's
	// state left as it was (a blind reset from a spoofed source).
	StatConntrackTCPIgnored = Stat(tcStatReasonSTAT_CT_TCP_IGNORED)
	// StatDropLoopback: frames from a pod addressed to or from a
	// loopback address (127.0.0.0/8, ::1), dropped on the pod's veth: no
	// pod reaches a node's localhost service, nor a NodePort on
	// 127.0.0.1, nor poses as a localhost client.
	StatDropLoopback = Stat(tcStatReasonSTAT_DROP_LOOPBACK)
	// StatDropUnparsed: packets to a frontend whose L4 header lies beyond
	// what the parser walks (an IPv6 extension chain longer than it
	// takes), dropped rather than passed on untranslated.
	StatDropUnparsed = Stat(tcStatReasonSTAT_DROP_UNPARSED)
	// StatDropReplyIface: replies, and ICMP errors about a flow, that
	// arrived on another interface than that flow's packets of their
	// direction do (a pod's veth where the backend is elsewhere, or
	// another pod's, or an uplink where the backend is a local pod):
	// forged, dropped rather than translated.
	StatDropReplyIface = Stat(tcStatReasonSTAT_DROP_REPLY_IFACE)
	// StatSourceProven: new flows taken from a proven source's own
	// budget (a client that completed a TCP handshake in the last five
	// minutes) instead of the cell it shares with unproven sources,
	// which a flood spoofing its address may have spent.
	StatSourceProven = Stat(tcStatReasonSTAT_CT_SRC_PROVEN)
	// StatSNATEvicted: source-NATed flows the backend answered but their
	// client did not (a spoofed source's, most likely) that lost their
	// port to a new flow finding no free one in its walk. Their reply
	// entry is replaced; their forward entry goes as an orphan.
	StatSNATEvicted = Stat(tcStatReasonSTAT_SNAT_EVICTED)

	numStats = int(tcStatReasonSTAT_MAX)
)

// Stable names. Each counter's name (the agent's metric label value, the
// `event` column of docs/datapath.md's Counters table) comes from its
// member of enum stat_reason in the object's BTF, as the layout
// fingerprint's enums do: the C name without STAT_, lower case, with the
// abbreviations of statNameWords spelled out. A new counter is written in
// bpf/consts.h and given a Go constant above; its name needs nothing more.

// statNameWords spell the C names' abbreviations out, one word each.
var statNameWords = map[string]string{
	"CT":     "conntrack",
	"FRAG":   "fragment",
	"REVNAT": "reverse_nat",
	"SRC":    "source",
	"XLATE":  "translated",
}

// statNameExceptions are the counters whose stable name the rule does not
// give: names exported before the rule existed, kept because dashboards
// and alerts select on them. Add nothing here for a new counter; rename
// its enum member instead.
var statNameExceptions = map[string]string{
	"STAT_DROP_REWRITE":         "drop_rewrite_error",
	"STAT_CT_EXPIRED":           "conntrack_expired_hit",
	"STAT_REJECT_LIMITED":       "reject_rate_limited",
	"STAT_DROP_CT_SOURCE_LIMIT": "drop_source_limit",
	"STAT_SOCK_REVNAT_CLOBBER":  "sock_revnat_clobbered",
	"STAT_CT_SRC_PROVEN":        "source_proven",
}

// statRuleName is the stable name the rule gives the enum member cname
// (STAT_CT_SWEPT: conntrack_swept).
func statRuleName(cname string) string {
	words := strings.Split(strings.TrimPrefix(cname, "STAT_"), "_")
	for i, w := range words {
		if long, ok := statNameWords[w]; ok {
			words[i] = long
		} else {
			words[i] = strings.ToLower(w)
		}
	}
	return strings.Join(words, "_")
}

// statNames maps every counter of enum stat_reason (STAT_MAX aside) to its
// stable name, read once from the embedded tc object's BTF. An error means
// the object is broken (TestStatNames fails on it).
var statNames = sync.OnceValues(func() (map[Stat]string, error) {
	spec, err := btf.LoadSpecFromReader(bytes.NewReader(_TcBytes))
	if err != nil {
		return nil, fmt.Errorf("read tc object's BTF: %w", err)
	}
	var reasons *btf.Enum
	if err := spec.TypeByName("stat_reason", &reasons); err != nil {
		return nil, fmt.Errorf("enum stat_reason: %w", err)
	}
	names := make(map[Stat]string, len(reasons.Values))
	for _, v := range reasons.Values {
		if v.Name == "STAT_MAX" {
			continue
		}
		n, ok := statNameExceptions[v.Name]
		if !ok {
			n = statRuleName(v.Name)
		}
		names[Stat(v.Value)] = n
	}
	return names, nil
})

// String returns the counter's stable name, or stat(N) for a number that
// is no member of enum stat_reason.
func (s Stat) String() string {
	if names, err := statNames(); err == nil {
		if n, ok := names[s]; ok {
			return n
		}
	}
	return fmt.Sprintf("stat(%d)", uint32(s))
}
