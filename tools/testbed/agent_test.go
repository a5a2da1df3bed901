package testbed

import (
	"testing"
	"time"
)

func TestAgentReadyTimeout(t *testing.T) {
	for _, c := range []struct {
		name, env string
		want      time.Duration
		// scaled is ScaleTimeout(2s).
		scaled  time.Duration
		wantErr bool
	}{
		{"unset", "", DefaultAgentReadyTimeout, 2 * time.Second, false},
		{"minutes", "5m", 5 * time.Minute, 10 * time.Second, false},
		{"shorter than the default", "30s", 30 * time.Second, 2 * time.Second, false},
		{"no unit", "300", 0, 0, true},
		{"zero", "0s", 0, 0, true},
		{"negative", "-1m", 0, 0, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv(AgentReadyTimeoutEnv, c.env)
			got, err := AgentReadyTimeout()
			if got != c.want || (err != nil) != c.wantErr {
				t.Errorf("%s=%q: %v, %v; want %v, error %v", AgentReadyTimeoutEnv, c.env, got, err, c.want, c.wantErr)
			}
			scaled, err := ScaleTimeout(2 * time.Second)
			if (err != nil) != c.wantErr || (err == nil && scaled != c.scaled) {
				t.Errorf("%s=%q: ScaleTimeout(2s) = %v, %v; want %v, error %v", AgentReadyTimeoutEnv, c.env, scaled, err, c.scaled, c.wantErr)
			}
		})
	}
}
