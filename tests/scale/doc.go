// Package scale holds topolb's cluster-scale benchmark (BenchmarkScale,
// `make bench-scale`, issue 33): a real etcd and kube-apiserver, N
// simulated Nodes posting their status, Services and EndpointSlices with a
// rolling update, K topolb agents without a datapath (--datapath=none) and
// one kube-proxy in nftables mode in a network namespace of its own, side
// by side. It measures what each costs the apiserver and itself: watch
// events and bytes, CPU, RSS and sync latency. It only runs with -bench;
// `go test` alone runs nothing here.
package scale
