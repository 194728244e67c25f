package host

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/natshard/natshard/internal/natstest"
)

// TestHostEvict: a split's eviction stops the entities of a shard that now
// belong to a child (their Stop hook runs), an idle one at once and a busy
// one once it has handled what was queued for it, and reports done only
// then; the shard's other entities stay, and a remembered entity is not
// forgotten (its child starts it again).
func TestHostEvict(t *testing.T) {
	var mu sync.Mutex
	var stopped, handled []string
	gate := make(chan struct{})
	byInc := map[int]string{}
	var forgot []string
	f := &testFactory{
		handle: func(inc int, m *Message) ([]byte, error) {
			if string(m.Data) == "block" {
				<-gate
			}
			mu.Lock()
			handled = append(handled, byInc[inc]+":"+string(m.Data))
			mu.Unlock()
			return nil, nil
		},
		stop: func(inc int) error {
			mu.Lock()
			stopped = append(stopped, byInc[inc])
			mu.Unlock()
			return nil
		},
	}
	factory := func(ctx context.Context, id string) (Entity, error) {
		e, err := f.factory(ctx, id)
		if err != nil {
			return nil, err
		}
		mu.Lock()
		byInc[e.(*testEntity).inc] = id // not f.calls: the entities start at once, on their own workers
		mu.Unlock()
		return e, nil
	}
	rec := newRecorder()
	h := newTestHost(t, factory, rec, func(c *Config) {
		c.Remember = func(context.Context, int, string) error { return nil }
		c.Forget = func(_ int, id string) {
			mu.Lock()
			forgot = append(forgot, id)
			mu.Unlock()
		}
	})
	for _, id := range []string{"stay", "go-idle", "go-busy"} {
		h.Deliver(0, id, pub(id, "1"))
	}
	natstest.Eventually(t, 30*time.Second, "three handled", func() bool { mu.Lock(); defer mu.Unlock(); return len(handled) == 3 })
	h.Deliver(0, "go-busy", pub("go-busy", "block"))
	h.Deliver(0, "go-busy", pub("go-busy", "after"))
	natstest.Eventually(t, 30*time.Second, "go-busy blocked", func() bool { return !quiet(h) })
	done := h.Evict(0, func(id string) bool { return strings.HasPrefix(id, "go-") })
	natstest.Eventually(t, 30*time.Second, "go-idle stopped", func() bool { mu.Lock(); defer mu.Unlock(); return slices.Contains(stopped, "go-idle") })
	select {
	case <-done:
		t.Fatal("eviction done while go-busy still had messages")
	default:
	}
	close(gate)
	<-done
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(handled[3:], []string{"go-busy:block", "go-busy:after"}) {
		t.Errorf("handled %v: go-busy's queued messages must be handled before it stops", handled)
	}
	if slices.Contains(stopped, "stay") || len(stopped) != 2 {
		t.Errorf("stopped %v, want go-idle and go-busy only", stopped)
	}
	if got := h.Entities(0); !slices.Equal(got, []string{"stay"}) {
		t.Errorf("shard 0 holds %v, want [stay]", got)
	}
	if len(forgot) != 0 {
		t.Errorf("evicted entities were forgotten: %v", forgot)
	}
	// Nothing to evict: done at once.
	<-h.Evict(0, func(string) bool { return false })
	<-h.Evict(7, func(string) bool { return true })
}
