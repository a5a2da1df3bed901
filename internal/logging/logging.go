// Package logging gives topolb's commands the logging flags and formats of
// Kubernetes components (k8s.io/component-base/logs/api/v1): -v is klog's
// verbosity, --logging-format is "text" (klog's) or "json", and the
// *slog.Logger the code logs through writes to klog, so topolb's own lines
// and client-go's come out in one format. slog levels map to klog's
// verbosity as logr maps them: Info is V(0), Debug V(4) (Kubernetes'
// "debug level"), Debug-1 V(5) ("trace level").
package logging

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"strconv"
	"time"

	"github.com/go-logr/logr"
	"github.com/spf13/pflag"
	logsapi "k8s.io/component-base/logs/api/v1"
	"k8s.io/klog/v2"
)

func init() {
	// Commands that run more than once in a process (tests) apply the
	// same flags again.
	logsapi.ReapplyHandling = logsapi.ReapplyHandlingIgnoreUnchanged
	if err := logsapi.RegisterLogFormat("json", jsonFormat{}, logsapi.LoggingStableOptions); err != nil {
		panic(fmt.Sprintf("register the json log format: %v", err))
	}
}

// Options are the logging flags of one command.
type Options struct {
	c *logsapi.LoggingConfiguration
}

// AddFlags adds the logging flags of Kubernetes components to fs: -v,
// --vmodule, --logging-format, --log-flush-frequency and the alpha output
// routing options.
func AddFlags(fs *pflag.FlagSet) *Options {
	c := logsapi.NewLoggingConfiguration()
	logsapi.AddFlags(c, fs)
	return &Options{c: c}
}

// Apply validates the flags, makes klog write in the chosen format at the
// chosen verbosity, and returns the logger that writes through it.
func (o *Options) Apply() (*slog.Logger, error) {
	if err := logsapi.ValidateAndApply(o.c, nil); err != nil {
		return nil, fmt.Errorf("logging flags: %w", err)
	}
	return slog.New(logr.ToSlogHandler(klog.Background())), nil
}

// Verbosity is -v.
func (o *Options) Verbosity() int { return int(o.c.Verbosity) }

// jsonFormat is --logging-format=json: one JSON object a line on stderr
// with the fields of Kubernetes components' JSON logs ("ts" in seconds
// since the epoch, "caller", "msg", "v" for info lines, then the
// key/value pairs).
type jsonFormat struct{}

func (jsonFormat) Create(c logsapi.LoggingConfiguration, o logsapi.LoggingOptions) (logr.Logger, logsapi.RuntimeControl) {
	level := new(slog.LevelVar)
	level.Set(slog.Level(-int(c.Verbosity)))
	h := slog.NewJSONHandler(o.ErrorStream, &slog.HandlerOptions{AddSource: true, Level: level, ReplaceAttr: k8sJSONAttr})
	return logr.FromSlogHandler(h), logsapi.RuntimeControl{SetVerbosityLevel: func(v uint32) error {
		level.Set(slog.Level(-int(v)))
		return nil
	}}
}

// k8sJSONAttr renames slog's built-in fields to Kubernetes' JSON log
// fields.
func k8sJSONAttr(groups []string, a slog.Attr) slog.Attr {
	if len(groups) > 0 {
		return a
	}
	switch a.Key {
	case slog.TimeKey:
		t := a.Value.Time()
		return slog.Float64("ts", float64(t.UnixNano())/float64(time.Second))
	case slog.LevelKey:
		l, ok := a.Value.Any().(slog.Level)
		if !ok || l >= slog.LevelError {
			return slog.Attr{}
		}
		return slog.Int("v", max(0, -int(l)))
	case slog.SourceKey:
		if s, ok := a.Value.Any().(*slog.Source); ok {
			return slog.String("caller", filepath.Base(s.File)+":"+strconv.Itoa(s.Line))
		}
	}
	return a
}

// AtLeast returns h's logger showing only records at level or above,
// whatever -v says: for a command whose helpers' info lines would clutter
// its own output.
func AtLeast(l *slog.Logger, level slog.Level) *slog.Logger {
	return slog.New(floor{l.Handler(), level})
}

type floor struct {
	slog.Handler
	min slog.Level
}

func (f floor) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= f.min && f.Handler.Enabled(ctx, l)
}

func (f floor) WithAttrs(as []slog.Attr) slog.Handler { return floor{f.Handler.WithAttrs(as), f.min} }
func (f floor) WithGroup(g string) slog.Handler       { return floor{f.Handler.WithGroup(g), f.min} }
