// Package e2e holds topolb's end-to-end tests: real traffic from client
// pods to Services on a multi-zone testbed of network namespaces
// (tools/testbed), load-balanced by topolb-agent on every node (or by the
// testbed's in-process datapath, to tell datapath from agent problems),
// with every landing compared to the decision topology.State.DecideNode
// makes for the client's node — the code `topolbctl explain` runs. It also
// compares topolb with kube-proxy: their programmed endpoints
// (TestKubeProxyAgrees; TestKubeProxyAgreesDualStack in both families)
// and their speed (BenchmarkE2E, `make bench-e2e`).
//
// TestDualStack runs its traffic checks once per IP family on a
// dual-stack testbed; a family the datapath does not program yet (as the
// agents report it) skips with that reason. TestICMPFollowsTheFlow
// (port unreachable, fragmentation needed / packet too big), the
// rollout and lifecycle tests (TestRollingUpdateKeepsConnections,
// TestPolicyFlipsKeepConnections, TestSessionAffinity) and BenchmarkE2E's
// pps row do the same (inEachFamily; pps_ipv6).
//
// TestMonitoring runs Debian's Prometheus against the agents, with the
// dashboard (deploy/grafana) and alert rules (deploy/prometheus) the
// project ships, and TestAlertRules their promtool unit tests.
//
// TOPOLB_E2E_SWITCH_PORTS=plain runs the testbed with switch ports that
// have no XDP program (a veth peer without NAPI, as a kind node's eth0):
// the agents' uplinks take the tc path instead of XDP. Run the north-south
// tests both ways:
//
//	go test -run 'TestNorthSouth|TestRejectEmptyService' ./tests/e2e/
//	TOPOLB_E2E_SWITCH_PORTS=plain go test -run 'TestNorthSouth|TestRejectEmptyService' ./tests/e2e/
//
// The tests need root and skip without it; those that need a real
// apiserver or kube-proxy skip without `make kube-bins` (and fail without
// it under TOPOLB_KUBE_REQUIRED, as `make test` sets). They build
// cmd/topolb-agent once (or take $TOPOLB_AGENT_BINARY) and leave no
// namespace, pin or process behind, also when they fail.
package e2e
