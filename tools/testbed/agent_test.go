package testbed

import (
	"testing"
	"time"
)

func TestAgentReadyTimeout(t *testing.T) {
	for _, c := range []struct {
		name, env string
		want      time.Duration
		wantErr   bool
	}{
		{"unset", "", DefaultAgentReadyTimeout, false},
		{"minutes", "5m", 5 * time.Minute, false},
		{"no unit", "300", 0, true},
		{"zero", "0s", 0, true},
		{"negative", "-1m", 0, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv(AgentReadyTimeoutEnv, c.env)
			got, err := AgentReadyTimeout()
			if got != c.want || (err != nil) != c.wantErr {
				t.Errorf("%s=%q: %v, %v; want %v, error %v", AgentReadyTimeoutEnv, c.env, got, err, c.want, c.wantErr)
			}
		})
	}
}
