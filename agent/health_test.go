package agent

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/topolb/topolb/kube"
	dpmaps "github.com/topolb/topolb/maps"
	"github.com/topolb/topolb/topology"
)

// blockingDP is a fakeDP whose writes block, once armed, until released:
// a datapath that never answers.
type blockingDP struct {
	*fakeDP
	mu      sync.Mutex
	armed   bool
	entered chan struct{} // receives once when a write blocks
	release chan struct{} // closed to let writes through
}

func (b *blockingDP) SetService(fe dpmaps.Frontend, s dpmaps.Service) (int, error) {
	b.mu.Lock()
	armed := b.armed
	b.armed = false
	b.mu.Unlock()
	if armed {
		b.entered <- struct{}{}
		<-b.release
	}
	return b.fakeDP.SetService(fe, s)
}

// getHealth fetches /healthz and decodes its body.
func getHealth(t *testing.T, url string) (int, Health) {
	t.Helper()
	resp, err := http.Get(url + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var h Health
	if err := json.NewDecoder(resp.Body).Decode(&h); err != nil {
		t.Fatalf("decode /healthz body: %v", err)
	}
	if want := resp.StatusCode == http.StatusOK; h.Healthy != want {
		t.Errorf("status %d with healthy=%v in the body", resp.StatusCode, h.Healthy)
	}
	return resp.StatusCode, h
}

// TestHealthzFailsWhenTheSyncLoopIsStuck wedges the sync loop on a datapath
// write that does not return, and checks /healthz: 200 while the sync is
// younger than the timeout, 503 naming the stuck sync after it, 200 again
// once the write returns and the loop catches up. Then, with the loop
// stopped, a change that nobody takes turns it to 503 as well. The clock is
// moved forward instead of waiting.
func TestHealthzFailsWhenTheSyncLoopIsStuck(t *testing.T) {
	dp := &blockingDP{fakeDP: newFakeDP(), armed: true, entered: make(chan struct{}, 1), release: make(chan struct{})}
	a := New(Config{NodeName: "a1", Options: topology.DefaultOptions(), HealthTimeout: time.Minute}, dp)
	var skew atomic.Int64
	a.now = func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }
	srv := httptest.NewServer(a.HealthHandler())
	defer srv.Close()

	tr := kube.NewTracker()
	tr.NodeChanged(nil, node("a1", "zone-a"))
	tr.ServiceChanged(nil, service("web", "10.96.0.1", nil))
	tr.SliceChanged(nil, epSlice("web", "web-1", endpoint{"10.0.1.1", "a1", "zone-a", "", true}))
	tr.Resync()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		a.Run(ctx, tr, 0, time.Hour)
	}()
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(dp.release) }) }
	defer func() {
		// Also on failure: a loop left blocked would hang the test.
		unblock()
		cancel()
		<-done
	}()

	select {
	case <-dp.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the sync never reached the datapath")
	}
	if code, h := getHealth(t, srv.URL); code != http.StatusOK || h.SyncingSince == nil {
		t.Fatalf("a sync younger than the timeout: %d %+v, want 200 with syncingSince", code, h)
	}

	skew.Store(int64(2 * time.Minute))
	code, h := getHealth(t, srv.URL)
	if code != http.StatusServiceUnavailable || !strings.Contains(h.Reason, "the sync loop is stuck") {
		t.Fatalf("a sync running past the timeout: %d %+v, want 503 naming the stuck sync", code, h)
	}
	// A change arriving meanwhile waits; the stuck sync is still the
	// reason given.
	tr.ServiceChanged(nil, service("api", "10.96.0.2", nil))
	if code, h := getHealth(t, srv.URL); code != http.StatusServiceUnavailable || h.PendingSince == nil {
		t.Errorf("stuck with a change waiting: %d %+v, want 503 with pendingSince", code, h)
	}

	unblock()
	deadline := time.Now().Add(10 * time.Second)
	for !a.Health().Healthy {
		if time.Now().After(deadline) {
			t.Fatalf("still unhealthy after the write returned: %+v", a.Health())
		}
		time.Sleep(5 * time.Millisecond)
	}
	if code, h := getHealth(t, srv.URL); code != http.StatusOK || h.LastSync == nil || h.SyncingSince != nil || h.PendingSince != nil {
		t.Errorf("after catching up: %d %+v, want 200 with lastSync only", code, h)
	}
	if !a.Synced() {
		t.Error("not synced after the stuck sync finished")
	}

	// Nothing takes changes any more: one that waits past the timeout
	// fails /healthz too.
	cancel()
	<-done
	skew.Store(0)
	tr.ServiceChanged(nil, service("db", "10.96.0.3", nil))
	if code, h := getHealth(t, srv.URL); code != http.StatusOK {
		t.Errorf("a fresh change: %d %+v, want 200", code, h)
	}
	skew.Store(int64(2 * time.Minute))
	if code, h := getHealth(t, srv.URL); code != http.StatusServiceUnavailable || !strings.Contains(h.Reason, "a change has waited") {
		t.Errorf("a change nobody took: %d %+v, want 503 naming the waiting change", code, h)
	}
}

// TestHealthDefaultTimeout checks the timeout used when none is configured.
func TestHealthDefaultTimeout(t *testing.T) {
	a := New(Config{NodeName: "a1"}, newFakeDP())
	if got := a.Health(); !got.Healthy || got.Timeout != DefaultHealthTimeout.Seconds() {
		t.Errorf("idle agent: %+v, want healthy with the default timeout", got)
	}
	tr := kube.NewTracker()
	a.live.watch(tr)
	tr.NodeChanged(nil, node("a1", "zone-a"))
	a.now = func() time.Time { return time.Now().Add(DefaultHealthTimeout - time.Second) }
	if got := a.Health(); !got.Healthy {
		t.Errorf("a change just under the default timeout: %+v", got)
	}
	a.now = func() time.Time { return time.Now().Add(DefaultHealthTimeout + time.Second) }
	if got := a.Health(); got.Healthy {
		t.Errorf("a change past the default timeout: %+v", got)
	}
}
