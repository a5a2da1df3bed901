package kube

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"

	"github.com/topolb/topolb/topology"
)

// The topology summary's objects, in the agents' namespace, and its
// write bounds. Agents with --node-watch=own read the summary
// (Watch); the agent that holds the Lease writes it (SummaryWriter).
const (
	// SummaryName is the ConfigMap holding the summary, under
	// topology.SummaryDataKey.
	SummaryName = "topolb-topology-summary"
	// SummaryLeaseName is the Lease the agents elect its writer with.
	SummaryLeaseName = "topolb-topology-summary"
	// SummaryMinInterval is the least time between two writes: the
	// cluster's whole cost is one ConfigMap update (and one watch event
	// to each agent) per 10 s at most, however often Nodes change.
	SummaryMinInterval = 10 * time.Second
	// SummaryRefresh is how often an unchanged summary is written again,
	// so that its age says whether its writer is alive.
	SummaryRefresh = 5 * time.Minute
	// SummaryStaleAfter is the age past which readers say their summary
	// is out of date: three refreshes missed.
	SummaryStaleAfter = 3 * SummaryRefresh
)

// The election's timing. Every agent is a candidate, and a candidate that
// does not hold the Lease reads it once per RetryPeriod: 5,000 nodes cost
// about 330 small GETs a second, no watch. The writer renews it as often.
// A writer that dies is replaced within LeaseDuration plus RetryPeriod;
// meanwhile readers keep the last summary.
const (
	summaryLeaseDuration = 60 * time.Second
	summaryRenewDeadline = 40 * time.Second
	summaryRetryPeriod   = 15 * time.Second
)

// SummaryInformerFactory returns an informer factory that lists and
// watches the summary ConfigMap only (a metadata.name field selector) in
// namespace.
func SummaryInformerFactory(c kubernetes.Interface, namespace string) informers.SharedInformerFactory {
	return informers.NewSharedInformerFactoryWithOptions(c, 0, informers.WithNamespace(namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", SummaryName).String()
		}))
}

// SummaryWriter runs for the topology summary's election and, while it
// holds the Lease, watches every Node and writes the summary
// (topology.BuildSummary): at most once every MinInterval, only when what
// it holds changed (a Node's heartbeat or any status change the summary
// does not hold writes nothing: summaries are compared, not resource
// versions), and again every Refresh when nothing changed.
type SummaryWriter struct {
	Client kubernetes.Interface
	// Namespace holds the Lease and the ConfigMap.
	Namespace string
	// Identity names this candidate in the Lease: the node name.
	Identity string
	// LabelKeys returns the label keys the Services' topology keys name
	// (topology.State.SummaryLabelKeys).
	LabelKeys func() []string
	Log       *slog.Logger
	// MinInterval, Refresh and Tick (how often changes are looked at)
	// default to SummaryMinInterval, SummaryRefresh and a second; tests
	// shorten them.
	MinInterval, Refresh, Tick time.Duration
	// MaxBytes bounds the summary; 0 is topology.MaxSummaryBytes.
	MaxBytes int
	// OnWrite, if set, is called after each write with the summary
	// written.
	OnWrite func(*topology.Summary)
	// lease overrides the election's timing (tests).
	lease struct{ duration, renew, retry time.Duration }
}

// Run takes part in the election until ctx is done, writing the summary
// while it leads; a writer that loses the Lease stands again.
func (w *SummaryWriter) Run(ctx context.Context) error {
	duration, renew, retry := summaryLeaseDuration, summaryRenewDeadline, summaryRetryPeriod
	if w.lease.duration != 0 {
		duration, renew, retry = w.lease.duration, w.lease.renew, w.lease.retry
	}
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Namespace: w.Namespace, Name: SummaryLeaseName},
		Client:     w.Client.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: w.Identity},
	}
	for ctx.Err() == nil {
		le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
			Lock: lock, LeaseDuration: duration, RenewDeadline: renew, RetryPeriod: retry,
			ReleaseOnCancel: true, Name: SummaryLeaseName,
			Callbacks: leaderelection.LeaderCallbacks{
				OnStartedLeading: func(ctx context.Context) {
					w.Log.Info("elected topology summary writer", "lease", w.Namespace+"/"+SummaryLeaseName)
					if err := w.lead(ctx); err != nil && ctx.Err() == nil {
						w.Log.Error("topology summary writer stopped", "err", err)
					}
				},
				OnStoppedLeading: func() {},
			},
		})
		if err != nil {
			return fmt.Errorf("topology summary election: %w", err)
		}
		le.Run(ctx)
	}
	return nil
}

// lead watches every Node and writes the summary until ctx is done.
func (w *SummaryWriter) lead(ctx context.Context) error {
	minInterval, refresh, tickEvery := orDefault(w.MinInterval, SummaryMinInterval), orDefault(w.Refresh, SummaryRefresh), orDefault(w.Tick, time.Second)
	maxBytes := w.MaxBytes
	if maxBytes == 0 {
		maxBytes = topology.MaxSummaryBytes
	}
	nf := informers.NewSharedInformerFactory(w.Client, 0)
	inf := nf.Core().V1().Nodes().Informer()
	if err := inf.SetTransform(trim); err != nil {
		return fmt.Errorf("set node informer transform: %w", err)
	}
	dirty := make(chan struct{}, 1)
	mark := func(any) {
		select {
		case dirty <- struct{}{}:
		default:
		}
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: mark, UpdateFunc: func(_, cur any) { mark(cur) }, DeleteFunc: mark,
	}); err != nil {
		return fmt.Errorf("watch nodes: %w", err)
	}
	nf.Start(ctx.Done())
	defer nf.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		return fmt.Errorf("node informer did not sync: %w", ctx.Err())
	}
	lister := nf.Core().V1().Nodes().Lister()

	// Adopt the summary a previous writer left: an unchanged one is not
	// written again before its refresh is due.
	last, err := w.read(ctx)
	if err != nil {
		w.Log.Warn("previous topology summary not read; writing a new one", "err", err)
	}
	var lastWrite time.Time
	var lastKeys []string
	if last != nil {
		lastWrite, lastKeys = last.Written, last.LabelKeys()
	}
	changed := true
	tick := time.NewTicker(tickEvery)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-dirty:
			changed = true
			continue
		case <-tick.C:
		}
		now := time.Now()
		if now.Sub(lastWrite) < minInterval {
			continue
		}
		keys := w.LabelKeys()
		due := now.Sub(lastWrite) >= refresh
		if !changed && !due && slices.Equal(keys, lastKeys) {
			continue
		}
		nodes, err := lister.List(labels.Everything())
		if err != nil {
			return fmt.Errorf("list nodes: %w", err)
		}
		model := make(map[string]topology.Node, len(nodes))
		for _, n := range nodes {
			model[n.Name] = topology.NodeFromObject(n, nil)
		}
		s, err := topology.BuildSummary(model, keys, maxBytes)
		if err != nil {
			w.Log.Error("topology summary not written", "err", err)
			changed, lastKeys = false, keys
			continue
		}
		changed, lastKeys = false, keys
		if !due && s.SameInputs(last) {
			continue
		}
		s.Written = now.UTC().Truncate(time.Second)
		if err := w.write(ctx, s); err != nil {
			w.Log.Error("topology summary not written; retrying", "err", err)
			changed = true
			continue
		}
		if len(s.Omitted) > 0 && (last == nil || !slices.Equal(last.Omitted, s.Omitted)) {
			w.Log.Warn("topology summary leaves out label keys to stay within its size bound; Services whose topology keys name them are decided by hints",
				"omitted", s.Omitted, "maxBytes", maxBytes)
		}
		w.Log.Debug("topology summary written", "nodes", len(model), "labelKeys", len(s.Labels), "refresh", due)
		last, lastWrite = s, now
		if w.OnWrite != nil {
			w.OnWrite(s)
		}
	}
}

// orDefault returns d, or def when d is 0.
func orDefault(d, def time.Duration) time.Duration {
	if d == 0 {
		return def
	}
	return d
}

// read returns the summary in the cluster, nil when there is none.
func (w *SummaryWriter) read(ctx context.Context) (*topology.Summary, error) {
	cm, err := w.Client.CoreV1().ConfigMaps(w.Namespace).Get(ctx, SummaryName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("get %s/%s: %w", w.Namespace, SummaryName, err)
	}
	return topology.DecodeSummary([]byte(cm.Data[topology.SummaryDataKey]))
}

// write stores s in the ConfigMap, creating it when it does not exist.
// Other data keys (a summary of another version) are dropped: one writer
// is elected.
func (w *SummaryWriter) write(ctx context.Context, s *topology.Summary) error {
	b, err := s.Encode()
	if err != nil {
		return err
	}
	cms := w.Client.CoreV1().ConfigMaps(w.Namespace)
	cm := &v1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: SummaryName, Namespace: w.Namespace, Labels: map[string]string{"app.kubernetes.io/name": "topolb"}},
		Data:       map[string]string{topology.SummaryDataKey: string(b)},
	}
	cur, err := cms.Get(ctx, SummaryName, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		if _, err := cms.Create(ctx, cm, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create %s/%s: %w", w.Namespace, SummaryName, err)
		}
		return nil
	case err != nil:
		return fmt.Errorf("get %s/%s: %w", w.Namespace, SummaryName, err)
	}
	cm.ResourceVersion = cur.ResourceVersion
	if _, err := cms.Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("update %s/%s: %w", w.Namespace, SummaryName, err)
	}
	return nil
}
