// Package e2e holds topolb's end-to-end tests: real traffic from client
// pods to Services on a multi-zone testbed of network namespaces
// (tools/testbed), load-balanced by topolb-agent on every node (or by the
// testbed's in-process datapath, to tell datapath from agent problems),
// with every landing compared to the decision topology.State.DecideNode
// makes for the client's node — the code `topolbctl explain` runs.
//
// The tests need root and skip without it. They build cmd/topolb-agent
// once (or take $TOPOLB_AGENT_BINARY) and leave no namespace, pin or agent
// behind, also when they fail.
package e2e
