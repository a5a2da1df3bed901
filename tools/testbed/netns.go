package testbed

import "github.com/topolb/topolb/internal/netns"

// NetnsDir is where named namespaces are bind-mounted, as `ip netns` does.
const NetnsDir = netns.Dir

// NS is a network namespace of the testbed: a node, a pod, the fabric or
// an outside network's namespace.
type NS = netns.NS

// ChecksumErrors are a namespace's receive checksum error counters (Udp,
// Udp6 and Tcp InCsumErrors). A datapath that writes a wrong checksum makes them
// grow, because the wire's senders have transmit checksum offload off.
type ChecksumErrors = netns.ChecksumErrors

// ChecksumErrors returns the non-zero checksum error counters of every
// namespace of the testbed, by namespace name.
func (tb *traffic) ChecksumErrors() (map[string]ChecksumErrors, error) {
	out := map[string]ChecksumErrors{}
	for _, ns := range tb.namespaces() {
		c, err := ns.ChecksumErrors()
		if err != nil {
			return nil, err
		}
		if c != (ChecksumErrors{}) {
			out[ns.Name] = c
		}
	}
	return out, nil
}
