package sidecar_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/sidecar"
)

// echoApp answers every message with its payload and its health check
// with 200 while healthy; with hangStops, its stop callback never
// answers.
type echoApp struct {
	healthy   atomic.Bool
	checks    atomic.Int64
	hangStops bool
	stops     atomic.Int64
}

func (e *echoApp) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.URL.Path == sidecar.HealthPath:
		e.checks.Add(1)
		if !e.healthy.Load() {
			http.Error(w, "not yet", http.StatusServiceUnavailable)
		}
	case strings.HasPrefix(r.URL.Path, "/entities/"):
		body, _ := io.ReadAll(r.Body)
		w.Write(body)
	case strings.HasPrefix(r.URL.Path, "/stop/") && e.hangStops:
		e.stops.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		select { // until the caller gives up
		case <-r.Context().Done():
		case <-time.After(10 * time.Second):
		}
	default:
		http.NotFound(w, r)
	}
}

// regionsOf asks the coordinator which regions it knows and how many
// shards each holds.
func regionsOf(nc *nats.Conn, typ string) (map[string]int, error) {
	m, err := nc.Request(protocol.MustSubjects("", "", typ).Admin(protocol.AdminStatus), nil, 2*time.Second)
	if err != nil {
		return nil, err
	}
	var st protocol.Status
	if err := json.Unmarshal(m.Data, &st); err != nil {
		return nil, err
	}
	out := map[string]int{}
	for _, r := range st.Regions {
		out[r.ID] = 0
	}
	for _, s := range st.Table {
		if s.State == "active" {
			out[s.Region]++
		}
	}
	return out, nil
}

// load sends requests to 50 entities from 4 goroutines until stopped,
// and keeps what failed.
type load struct {
	wg       sync.WaitGroup
	stop     atomic.Bool
	answered atomic.Int64
	mu       sync.Mutex
	failed   []error
}

func startLoad(client *natshard.Client, typ string) *load {
	l := &load{}
	for w := range 4 {
		l.wg.Go(func() {
			for i := 0; !l.stop.Load(); i++ {
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				body := fmt.Sprintf("%d-%d", w, i)
				got, err := client.Request(ctx, typ, fmt.Sprintf("e-%d", i%50), []byte(body))
				cancel()
				if err == nil && string(got) != body {
					err = fmt.Errorf("answered %q to %q", got, body)
				}
				if err != nil {
					l.mu.Lock()
					l.failed = append(l.failed, err)
					l.mu.Unlock()
					continue
				}
				l.answered.Add(1)
			}
		})
	}
	return l
}

// more waits until n more requests were answered.
func (l *load) more(t *testing.T, n int64) {
	t.Helper()
	from := l.answered.Load()
	natstest.Eventually(t, 30*time.Second, fmt.Sprintf("%d more requests answered", n), func() bool { return l.answered.Load() >= from+n })
}

// end stops the load, once more requests were answered after what the
// test did, and fails the test if a request failed.
func (l *load) end(t *testing.T, during string) {
	t.Helper()
	l.more(t, 50)
	l.stop.Store(true)
	l.wg.Wait()
	if len(l.failed) > 0 {
		t.Fatalf("%d requests failed while %s, the first: %v", len(l.failed), during, l.failed[0])
	}
	t.Logf("%d requests answered while %s; none failed", l.answered.Load(), during)
}

// TestRunReadinessAndDown: a process registers its region only once its
// app answers the health check. A graceful stop whose app never answers
// its stop callbacks goes on after the app timeout. When its app fails
// every check for DownAfter, a process leaves and Run returns ErrAppDown.
// In both leaves the shards move to the process whose app answers, and
// every request sent meanwhile is answered.
func TestRunReadinessAndDown(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	nc := natstest.Connect(t, url)
	client := natshard.NewClient(nc)
	typ := natshard.Type{Name: "echo", Shards: 8, RebalanceInterval: 200 * time.Millisecond}
	run := func(ctx context.Context, region string, app *echoApp) <-chan error {
		srv := serve(t, app, nil)
		done := make(chan error, 1)
		go func() {
			done <- sidecar.Run(ctx, natshard.Options{NATS: url, Region: region, Logger: quiet},
				sidecar.Config{App: srv.URL, Timeout: 300 * time.Millisecond, HealthInterval: 50 * time.Millisecond, DownAfter: 500 * time.Millisecond}, typ)
		}()
		return done
	}
	wait := func(what string, done <-chan error) error {
		t.Helper()
		select {
		case err := <-done:
			return err
		case <-time.After(30 * time.Second):
			t.Fatalf("%s: Run did not return within 30 s", what)
			return nil
		}
	}
	holds := func(want map[string]bool) func() bool {
		return func() bool {
			r, err := regionsOf(nc, "echo")
			if err != nil || len(r) != len(want) {
				return false
			}
			for id, n := range r {
				if !want[id] || n == 0 {
					return false
				}
			}
			return true
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	appA := &echoApp{}
	appA.healthy.Store(true)
	doneA := run(ctx, "a", appA)
	natstest.Eventually(t, 30*time.Second, "a holds every shard", holds(map[string]bool{"a": true}))

	// b waits for its app, then leaves gracefully; its app's stop
	// callbacks never answer.
	appB := &echoApp{hangStops: true}
	ctxB, cancelB := context.WithCancel(ctx)
	doneB := run(ctxB, "b", appB)
	natstest.Eventually(t, 30*time.Second, "b's app asked for its health 5 times", func() bool { return appB.checks.Load() >= 5 })
	if r, err := regionsOf(nc, "echo"); err != nil || len(r) != 1 {
		t.Fatalf("while b's app is not ready the coordinator knows %v (%v), want a alone", r, err)
	}
	appB.healthy.Store(true)
	natstest.Eventually(t, 30*time.Second, "b registered and given shards", holds(map[string]bool{"a": true, "b": true}))
	l := startLoad(client, "echo")
	l.more(t, 50)
	cancelB()
	if err := wait("b's graceful stop", doneB); err != nil {
		t.Fatalf("b's Run after a graceful stop: %v", err)
	}
	natstest.Eventually(t, 30*time.Second, "a holds every shard again", holds(map[string]bool{"a": true}))
	l.end(t, "b stopped, its app's stop callbacks timing out")
	if appB.stops.Load() == 0 {
		t.Fatal("b's app was asked no stop")
	}

	// c comes up, then its app goes down: c leaves.
	appC := &echoApp{}
	appC.healthy.Store(true)
	doneC := run(ctx, "c", appC)
	natstest.Eventually(t, 30*time.Second, "c registered and given shards", holds(map[string]bool{"a": true, "c": true}))
	l = startLoad(client, "echo")
	l.more(t, 50)
	appC.healthy.Store(false)
	err := wait("c's app down", doneC)
	if !errors.Is(err, sidecar.ErrAppDown) {
		t.Fatalf("c's Run: %v, want ErrAppDown", err)
	}
	t.Logf("c's Run returned: %v", err)
	natstest.Eventually(t, 30*time.Second, "a holds every shard again", holds(map[string]bool{"a": true}))
	l.end(t, "c's app went down and c left")

	cancel()
	if err := wait("a's stop", doneA); err != nil {
		t.Fatalf("a's Run after its context ended: %v", err)
	}
}

// TestWaitReadyUnreachable: an app that never answers is named, with the
// reason, when the wait ends.
func TestWaitReadyUnreachable(t *testing.T) {
	app := newApp(t, sidecar.Config{App: "http://127.0.0.1:1"})
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	err := app.WaitReady(ctx)
	if err == nil || !strings.Contains(err.Error(), "the app at http://127.0.0.1:1 did not answer its health check") || !strings.Contains(err.Error(), "connection refused") {
		t.Fatalf("WaitReady: %v", err)
	}
}
