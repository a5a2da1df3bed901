package agent

import (
	"context"
	"fmt"

	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"

	"github.com/topolb/topolb/topology"
)

// Event reasons the agent emits on Services.
const (
	ReasonModeChanged   = "TopologyModeChanged"
	ReasonProgramFailed = "TopologyProgramFailed"
	ReasonRefused       = "TopologyServiceRefused"
)

// KubeEvents emits Kubernetes Events through client-go's event recorder. The
// recorder's correlator aggregates similar events and its spam filter
// rate-limits each source and object (a burst of 25, then one event per
// five minutes), so a thousand nodes flipping at once stay a bounded load
// on the apiserver.
type KubeEvents struct {
	recorder    record.EventRecorder
	broadcaster record.EventBroadcaster
}

// NewKubeEvents returns an event sink writing to c as component
// topolb-agent on node.
func NewKubeEvents(c kubernetes.Interface, node string) *KubeEvents {
	b := record.NewBroadcasterWithCorrelatorOptions(record.CorrelatorOptions{
		BurstSize: 25,
		QPS:       1.0 / 300,
	})
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: c.CoreV1().Events("")})
	r := b.NewRecorder(scheme.Scheme, v1.EventSource{Component: "topolb-agent", Host: node})
	return &KubeEvents{recorder: r, broadcaster: b}
}

// ModeChanged implements EventSink.
func (k *KubeEvents) ModeChanged(svc *v1.Service, port string, from, to topology.Mode, reason string) {
	k.recorder.Eventf(svc, v1.EventTypeNormal, ReasonModeChanged, "port %q: mode %s -> %s: %s", port, from, to, reason)
}

// ProgramFailed implements EventSink.
func (k *KubeEvents) ProgramFailed(svc *v1.Service, err error) {
	k.recorder.Event(svc, v1.EventTypeWarning, ReasonProgramFailed, fmt.Sprintf("previous backends keep serving: %v", err))
}

// ServiceRefused implements EventSink.
func (k *KubeEvents) ServiceRefused(svc *v1.Service, r topology.Refusal) {
	k.recorder.Event(svc, v1.EventTypeWarning, ReasonRefused, r.String())
}

// Shutdown flushes and stops the recorder.
func (k *KubeEvents) Shutdown(context.Context) { k.broadcaster.Shutdown() }
