// Package api is what the test backend tools/cluster/echo prints: its
// answers to GET / and the summary of `echo get`, shared with the suite
// that reads them (tests/cluster).
package api

// Answer is what `echo serve` returns for GET /.
type Answer struct {
	Pod  string `json:"pod"`
	IP   string `json:"ip"`
	Node string `json:"node"`
	Zone string `json:"zone,omitempty"`
}

// Result is what `echo get` prints: requests made, answers per node and per
// pod IP, failed requests and, among them, connections reset, with the
// first few errors.
type Result struct {
	Requests int            `json:"requests"`
	ByNode   map[string]int `json:"byNode"`
	ByIP     map[string]int `json:"byIP"`
	Failed   int            `json:"failed"`
	Resets   int            `json:"resets"`
	Errors   []string       `json:"errors,omitempty"`
}
