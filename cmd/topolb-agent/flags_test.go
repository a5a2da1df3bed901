package main

import (
	"strings"
	"testing"
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

// TestTCAttachFlag: --tc-attach takes auto, tcx or tc, and refuses
// anything else naming the flag.
func TestTCAttachFlag(t *testing.T) {
	base := flags{nodeName: "n1", snatPorts: "61000-65535", nodePortRange: "30000-32767", uplinkPath: "auto"}
	for _, tt := range []struct {
		value   string
		want    string
		wantErr string
	}{
		{value: "auto", want: "auto"},
		{value: "tcx", want: "tcx"},
		{value: "tc", want: "tc"},
		{value: "clsact", wantErr: `--tc-attach: tc attach mode "clsact": want auto, tcx or tc`},
		{value: "", wantErr: "--tc-attach"},
	} {
		t.Run(tt.value, func(t *testing.T) {
			f := base
			f.tcAttach = tt.value
			s, err := checkFlags(f)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || string(s.tcAttach) != tt.want {
				t.Errorf("got %q, %v; want %q", s.tcAttach, err, tt.want)
			}
		})
	}
}

// TestUplinkPathFlag: --uplink-path takes auto, xdp or tc, and refuses
// anything else naming the flag.
func TestUplinkPathFlag(t *testing.T) {
	base := flags{nodeName: "n1", snatPorts: "61000-65535", nodePortRange: "30000-32767", tcAttach: "auto"}
	for _, tt := range []struct {
		value   string
		want    string
		wantErr string
	}{
		{value: "auto", want: "auto"},
		{value: "xdp", want: "xdp"},
		{value: "tc", want: "tc"},
		{value: "generic", wantErr: `--uplink-path: uplink path "generic": want auto, xdp or tc`},
		{value: "", wantErr: "--uplink-path"},
	} {
		t.Run(tt.value, func(t *testing.T) {
			f := base
			f.uplinkPath = tt.value
			s, err := checkFlags(f)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || string(s.uplinkPath) != tt.want {
				t.Errorf("got %q, %v; want %q", s.uplinkPath, err, tt.want)
			}
		})
	}
}
