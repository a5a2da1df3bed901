package main

import (
	"strings"
	"testing"

	"github.com/topolb/topolb/kube"
)

func TestMetricsListenAddress(t *testing.T) {
	tests := []struct {
		name string
		f    flags
		want string
		// wantErr is a part of the error; "" for none.
		wantErr string
	}{
		{name: "localhost by default", f: flags{metricsAddress: "127.0.0.1:9965", nodeIP: "192.0.2.7"}, want: "127.0.0.1:9965"},
		{name: "disabled", f: flags{metricsAddress: ""}, want: ""},
		{name: "opt in: the node IP at the port", f: flags{metricsAddress: "127.0.0.1:9965", metricsNodeIP: true, nodeIP: "192.0.2.7"}, want: "192.0.2.7:9965"},
		{name: "opt in, IPv6 node", f: flags{metricsAddress: "127.0.0.1:9965", metricsNodeIP: true, nodeIP: "2001:db8::7"}, want: "[2001:db8::7]:9965"},
		{name: "opt in without a node IP", f: flags{metricsAddress: "127.0.0.1:9965", metricsNodeIP: true}, wantErr: "needs this node's IP"},
		{name: "opt in with a bad node IP", f: flags{metricsAddress: "127.0.0.1:9965", metricsNodeIP: true, nodeIP: "$(NODE_IP)"}, wantErr: `got "$(NODE_IP)"`},
		{name: "opt in without a port", f: flags{metricsAddress: "", metricsNodeIP: true, nodeIP: "192.0.2.7"}, wantErr: "takes the port of --metrics-address"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := metricsListenAddress(tt.f)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Errorf("got %q, %v; want %q", got, err, tt.want)
			}
		})
	}
}

// TestChoiceFlags: --uplink-path takes auto, xdp or tc, --tc-attach
// auto, tcx or tc, --datapath bpf or none, --node-watch own or all;
// anything else is refused naming the flag.
func TestChoiceFlags(t *testing.T) {
	base := flags{nodeName: "n1", snatPorts: "61000-65535", nodePortRange: "30000-32767", uplinkPath: "auto", tcAttach: "auto", datapath: datapathBPF,
		nodeWatch: "own", summaryNamespace: "topolb-system"}
	uplinkPath := func(f *flags) *string { return &f.uplinkPath }
	tcAttach := func(f *flags) *string { return &f.tcAttach }
	datapath := func(f *flags) *string { return &f.datapath }
	nodeWatch := func(f *flags) *string { return &f.nodeWatch }
	// --datapath is read from flags, not settings: accepted is all a row
	// can check.
	accepted := func(settings) string { return "accepted" }
	for _, tt := range []struct {
		flag    func(*flags) *string
		got     func(settings) string
		value   string
		want    string
		wantErr string
	}{
		{uplinkPath, func(s settings) string { return string(s.uplinkPath) }, "auto", "auto", ""},
		{uplinkPath, func(s settings) string { return string(s.uplinkPath) }, "xdp", "xdp", ""},
		{uplinkPath, func(s settings) string { return string(s.uplinkPath) }, "tc", "tc", ""},
		{uplinkPath, nil, "generic", "", `--uplink-path: uplink path "generic": want auto, xdp or tc`},
		{uplinkPath, nil, "", "", "--uplink-path"},
		{tcAttach, func(s settings) string { return string(s.tcAttach) }, "auto", "auto", ""},
		{tcAttach, func(s settings) string { return string(s.tcAttach) }, "tcx", "tcx", ""},
		{tcAttach, func(s settings) string { return string(s.tcAttach) }, "tc", "tc", ""},
		{tcAttach, nil, "clsact", "", `--tc-attach: tc attach mode "clsact": want auto, tcx or tc`},
		{tcAttach, nil, "", "", "--tc-attach"},
		{datapath, accepted, datapathBPF, "accepted", ""},
		{datapath, accepted, datapathNone, "accepted", ""},
		{datapath, nil, "off", "", `--datapath "off": want "bpf" or "none"`},
		{nodeWatch, func(s settings) string { return string(s.watch.Nodes) }, "own", "own", ""},
		{nodeWatch, func(s settings) string { return string(s.watch.Nodes) }, "all", "all", ""},
		{nodeWatch, nil, "mine", "", `--node-watch "mine": want own or all`},
	} {
		f := base
		*tt.flag(&f) = tt.value
		s, err := checkFlags(f)
		if tt.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("%q: error %v, want one containing %q", tt.value, err, tt.wantErr)
			}
			continue
		}
		if err != nil || tt.got(s) != tt.want {
			t.Errorf("%q: got %q, %v; want %q", tt.value, tt.got(s), err, tt.want)
		}
	}
}

// TestNodeWatchNamespace: --node-watch=own with a cluster needs the
// namespace of the topology summary; --from-file reads every Node from
// the file and needs none, nor does --node-watch=all.
func TestNodeWatchNamespace(t *testing.T) {
	for _, tt := range []struct {
		name                string
		nodeWatch, fromFile string
		namespace           string
		// want is what the informers watch; wantErr a substring of the
		// error, "" for none.
		want    kube.WatchOptions
		wantErr string
	}{
		{name: "own in a namespace", nodeWatch: "own", namespace: "topolb-system",
			want: kube.WatchOptions{Nodes: kube.NodeWatchOwn, NodeName: "n1", SummaryNamespace: "topolb-system"}},
		{name: "own without a namespace", nodeWatch: "own", wantErr: "set --summary-namespace or $POD_NAMESPACE"},
		{name: "all needs no namespace", nodeWatch: "all", want: kube.WatchOptions{Nodes: kube.NodeWatchAll, NodeName: "n1"}},
		{name: "from a file nothing is watched", nodeWatch: "own", fromFile: "/dev/null"},
	} {
		f := flags{nodeName: "n1", snatPorts: "61000-65535", nodePortRange: "30000-32767", uplinkPath: "auto", tcAttach: "auto", datapath: datapathBPF,
			nodeWatch: tt.nodeWatch, fromFile: tt.fromFile, summaryNamespace: tt.namespace}
		s, err := checkFlags(f)
		if tt.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("%s: error %v, want one containing %q", tt.name, err, tt.wantErr)
			}
			continue
		}
		if err != nil || s.watch != tt.want {
			t.Errorf("%s: watch %+v, %v; want %+v", tt.name, s.watch, err, tt.want)
		}
	}
}
