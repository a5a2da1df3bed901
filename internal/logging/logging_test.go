package logging

import (
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/go-logr/logr"
	logsapi "k8s.io/component-base/logs/api/v1"
)

// TestJSONFormat: --logging-format=json writes one object a line with
// Kubernetes' fields (ts, caller, msg, v; errors without v), and -v 4
// shows Debug but not Debug-1 (klog's V(5)).
func TestJSONFormat(t *testing.T) {
	var out strings.Builder
	c := logsapi.NewLoggingConfiguration()
	c.Verbosity = 4
	l, _ := jsonFormat{}.Create(*c, logsapi.LoggingOptions{ErrorStream: &out})
	log := slog.New(logr.ToSlogHandler(l))
	log.Info("agent started", "node", "n1")
	log.Debug("a debug line")
	log.Log(t.Context(), slog.LevelDebug-1, "a map write")
	log.Error("sync failed", "err", errors.New("boom"))
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 3 {
		t.Fatalf("%d lines at -v 4, want 3 (info, debug, error):\n%s", len(lines), out.String())
	}
	want := []map[string]any{
		{"msg": "agent started", "v": 0.0, "node": "n1"},
		{"msg": "a debug line", "v": 4.0},
		{"msg": "sync failed", "err": "boom"},
	}
	for i, line := range lines {
		var got map[string]any
		if err := json.Unmarshal([]byte(line), &got); err != nil {
			t.Fatalf("line %d is not JSON: %v: %s", i, err, line)
		}
		for k, v := range want[i] {
			if got[k] != v {
				t.Errorf("line %d: %s = %v, want %v (%s)", i, k, got[k], v, line)
			}
		}
		if ts, ok := got["ts"].(float64); !ok || ts < 1e9 {
			t.Errorf("line %d: ts %v, want seconds since the epoch", i, got["ts"])
		}
		if c, _ := got["caller"].(string); !strings.HasPrefix(c, "logging_test.go:") {
			t.Errorf("line %d: caller %q, want this file", i, c)
		}
		if _, hasV := got["v"]; i == 2 && hasV || i < 2 && !hasV {
			t.Errorf("line %d: v present %t (errors carry none)", i, hasV)
		}
		if _, old := got["level"]; old {
			t.Errorf("line %d still has slog's level: %s", i, line)
		}
	}
}

// TestAtLeast: a floor hides what is below it, whatever the handler
// allows.
func TestAtLeast(t *testing.T) {
	var out strings.Builder
	log := AtLeast(slog.New(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelDebug})), slog.LevelWarn)
	log.With("k", "v").Info("hidden")
	log.WithGroup("g").Warn("shown")
	if s := out.String(); strings.Contains(s, "hidden") || !strings.Contains(s, "shown") {
		t.Errorf("output %q: want only the warning", s)
	}
}
