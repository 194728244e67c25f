package host

import (
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/region/internal/host/hosttest"
)

// timerLog records the timer messages an entity handled.
type timerLog struct {
	mu  sync.Mutex
	got []string // name=data
}

func (l *timerLog) add(m *Message) {
	l.mu.Lock()
	l.got = append(l.got, m.Timer()+"="+string(m.Data))
	l.mu.Unlock()
}

func (l *timerLog) list() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.got...)
}

// queued reports how many messages wait in entity id's mailbox.
func queued(h *Host, shard int, id string) int {
	se := h.lookup(shard)
	if se == nil {
		return 0
	}
	se.mu.Lock()
	defer se.mu.Unlock()
	if c := se.cells[id]; c != nil {
		return c.mailbox.len()
	}
	return 0
}

// TestTimerInTurn: a periodic timer's messages are handled in the
// entity's turn, never while Handle runs for another message: the
// entity's counter of Handle calls in flight never exceeds 1, and its
// unguarded state is written by both (the race detector checks it).
func TestTimerInTurn(t *testing.T) {
	var (
		h        *Host
		inFlight atomic.Int32
		overlaps atomic.Int32
		ticks    int // the entity's own state: no lock
		ticked   atomic.Int32
	)
	f := &testFactory{handle: func(_ int, m *Message) ([]byte, error) {
		if inFlight.Add(1) != 1 {
			overlaps.Add(1)
		}
		defer inFlight.Add(-1)
		switch {
		case m.Timer() == "tick":
			ticks++
			ticked.Store(int32(ticks))
			time.Sleep(100 * time.Microsecond)
		case string(m.Data) == "arm":
			if err := h.StartTimer(m.Shard, m.EntityID, "tick", time.Millisecond, true, []byte("t")); err != nil {
				return nil, err
			}
		default:
			ticks += 0 // read and write the state beside the timer's messages
			time.Sleep(50 * time.Microsecond)
		}
		return []byte(strconv.Itoa(ticks)), nil
	}}
	rec := newRecorder()
	h = newTestHost(t, f.factory, rec, nil)
	h.Deliver(0, "a", req("a", "arm"))
	if r := rec.next(t); r.err != nil {
		t.Fatalf("arm: %v", r.err)
	}
	for i := 0; i < 300; i++ {
		h.Deliver(0, "a", pub("a", "msg"))
		if i%10 == 0 {
			time.Sleep(200 * time.Microsecond)
		}
	}
	natstest.Eventually(t, 5*time.Second, "20 ticks", func() bool { return ticked.Load() >= 20 })
	if n := overlaps.Load(); n != 0 {
		t.Fatalf("Handle ran %d times while another Handle ran", n)
	}
	if !h.CancelTimer(0, "a", "tick") {
		t.Fatal("cancelTimer of an armed periodic timer = false")
	}
	if h.TimerActive(0, "a", "tick") {
		t.Fatal("timer active after cancel")
	}
	if f.calls.Load() != 1 {
		t.Fatalf("factory called %d times, want 1", f.calls.Load())
	}
}

// TestTimerReset: starting a timer of the same name replaces it, even
// when the first one's message is queued already: only the second comes.
func TestTimerReset(t *testing.T) {
	var (
		h       *Host
		log     timerLog
		release = make(chan struct{})
	)
	f := &testFactory{handle: func(_ int, m *Message) ([]byte, error) {
		if m.Timer() != "" {
			log.add(m)
			return nil, nil
		}
		switch string(m.Data) {
		case "long":
			return nil, h.StartTimer(m.Shard, m.EntityID, "t", time.Hour, false, []byte("long"))
		case "short":
			// Reset to a short one, then keep the turn until its
			// message is queued, and reset it again.
			if err := h.StartTimer(m.Shard, m.EntityID, "t", time.Millisecond, false, []byte("old")); err != nil {
				return nil, err
			}
			<-release
			return nil, h.StartTimer(m.Shard, m.EntityID, "t", time.Millisecond, false, []byte("new"))
		}
		return nil, nil
	}}
	rec := newRecorder()
	h = newTestHost(t, f.factory, rec, nil)
	h.Deliver(0, "a", req("a", "long"))
	rec.next(t)
	if !h.TimerActive(0, "a", "t") {
		t.Fatal("timer not active")
	}
	h.Deliver(0, "a", req("a", "short"))
	natstest.Eventually(t, 5*time.Second, "the old timer's message queued", func() bool { return queued(h, 0, "a") == 1 })
	close(release)
	rec.next(t)
	natstest.Eventually(t, 5*time.Second, "a timer message", func() bool { return len(log.list()) > 0 })
	natstest.Eventually(t, 5*time.Second, "idle", func() bool { return quiet(h) })
	if got := log.list(); len(got) != 1 || got[0] != "t=new" {
		t.Fatalf("timer messages %q, want only t=new", got)
	}
	if h.TimerActive(0, "a", "t") {
		t.Fatal("a single-shot timer is active after its message")
	}
}

// TestTimerCancelledByPassivation: an entity's timers (armed, or with a
// message queued) end with its activation: no timer message reaches
// Handle after it stopped, and none activates a new incarnation.
func TestTimerCancelledByPassivation(t *testing.T) {
	inBubble(t, func(t *testing.T) {
		var (
			h     *Host
			log   timerLog
			stops atomic.Int32
		)
		f := &testFactory{
			handle: func(_ int, m *Message) ([]byte, error) {
				if m.Timer() != "" {
					log.add(m)
					return nil, nil
				}
				if err := h.StartTimer(m.Shard, m.EntityID, "armed", 20*time.Millisecond, false, nil); err != nil {
					return nil, err
				}
				if err := h.StartTimer(m.Shard, m.EntityID, "queued", 0, false, nil); err != nil {
					return nil, err
				}
				// Keep the turn until the second timer's message is queued,
				// then passivate: the entity stops once this message is done.
				for queued(h, m.Shard, m.EntityID) == 0 {
					time.Sleep(100 * time.Microsecond)
				}
				h.Passivate(m.Shard, m.EntityID)
				return nil, nil
			},
			stop: func(int) error { stops.Add(1); return nil },
		}
		rec := newRecorder()
		h = newTestHost(t, f.factory, rec, nil)
		h.Deliver(0, "a", req("a", "go"))
		rec.next(t)
		natstest.Eventually(t, 5*time.Second, "entity stopped and removed", func() bool { return stops.Load() == 1 && h.Active() == 0 })
		time.Sleep(100 * time.Millisecond) // in the bubble: past the timer's due time, every goroutine idle
		synctest.Wait()
		if got := log.list(); len(got) != 0 {
			t.Fatalf("timer messages after passivation: %q", got)
		}
		if n := f.calls.Load(); n != 1 {
			t.Fatalf("factory called %d times, want 1 (a cancelled timer activated the entity)", n)
		}
		if err := h.StartTimer(0, "a", "x", time.Millisecond, false, nil); !errors.Is(err, ErrNotActive) {
			t.Fatalf("startTimer of an inactive entity: %v, want ErrNotActive", err)
		}
	})
}

// TestTimerCancelledByShardStop: a shard that leaves the region (the
// stop of a handoff) cancels its entities' timers, armed or queued, and a
// timer message queued before the stop never reaches Handle.
func TestTimerCancelledByShardStop(t *testing.T) {
	inBubble(t, func(t *testing.T) {
		var (
			h       *Host
			log     timerLog
			release = make(chan struct{})
		)
		f := &testFactory{handle: func(_ int, m *Message) ([]byte, error) {
			if m.Timer() != "" {
				log.add(m)
				return nil, nil
			}
			if err := h.StartTimer(m.Shard, m.EntityID, "armed", 20*time.Millisecond, true, nil); err != nil {
				return nil, err
			}
			if err := h.StartTimer(m.Shard, m.EntityID, "queued", 0, false, nil); err != nil {
				return nil, err
			}
			<-release
			return nil, nil
		}}
		rec := newRecorder()
		h = newTestHost(t, f.factory, rec, nil)
		h.Deliver(3, "a", pub("a", "go"))
		natstest.Eventually(t, 5*time.Second, "timer message queued", func() bool { return queued(h, 3, "a") == 1 })
		done := make(chan error, 1)
		go func() { done <- h.StopShard(t.Context(), 3) }()
		natstest.Eventually(t, 5*time.Second, "shard closing", func() bool {
			se := h.lookup(3)
			se.mu.Lock()
			defer se.mu.Unlock()
			return se.closing
		})
		close(release)
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond) // in the bubble: past the timer's due time, every goroutine idle
		synctest.Wait()
		if got := log.list(); len(got) != 0 {
			t.Fatalf("timer messages after the shard stopped: %q", got)
		}
		if n := h.Active(); n != 0 {
			t.Fatalf("%d entities active after the shard stopped", n)
		}
	})
}

// TestTimerCancelledByAbort: a shard dropped or fenced (abortShard)
// cancels its timers at once.
func TestTimerCancelledByAbort(t *testing.T) {
	inBubble(t, func(t *testing.T) {
		var (
			h   *Host
			log timerLog
		)
		f := &testFactory{handle: func(_ int, m *Message) ([]byte, error) {
			if m.Timer() != "" {
				log.add(m)
				return nil, nil
			}
			return nil, h.StartTimer(m.Shard, m.EntityID, "t", 30*time.Millisecond, false, nil)
		}}
		rec := newRecorder()
		h = newTestHost(t, f.factory, rec, nil)
		h.Deliver(1, "a", req("a", "go"))
		rec.next(t)
		h.AbortShard(1)
		if h.TimerActive(1, "a", "t") {
			t.Fatal("timer active after abortShard")
		}
		time.Sleep(100 * time.Millisecond) // in the bubble: past the timer's due time, every goroutine idle
		synctest.Wait()
		if got := log.list(); len(got) != 0 {
			t.Fatalf("timer messages after abortShard: %q", got)
		}
	})
}

// TestTimerPanicEndsTimers: a panic in Handle drops the incarnation and
// its timers.
func TestTimerPanicEndsTimers(t *testing.T) {
	inBubble(t, func(t *testing.T) {
		var (
			h   *Host
			log timerLog
		)
		f := &testFactory{handle: func(_ int, m *Message) ([]byte, error) {
			if m.Timer() != "" {
				log.add(m)
				return nil, nil
			}
			if err := h.StartTimer(m.Shard, m.EntityID, "t", 20*time.Millisecond, false, nil); err != nil {
				return nil, err
			}
			panic("boom")
		}}
		rec := newRecorder()
		h = newTestHost(t, f.factory, rec, nil)
		h.Deliver(0, "a", req("a", "go"))
		if r := rec.next(t); !errors.Is(r.err, errEntityPanicked) {
			t.Fatalf("reply error %v, want errEntityPanicked", r.err)
		}
		time.Sleep(100 * time.Millisecond) // in the bubble: past the timer's due time, every goroutine idle
		synctest.Wait()
		if got := log.list(); len(got) != 0 {
			t.Fatalf("timer messages after a panic: %q", got)
		}
	})
}

// TestTimerNoCostWithout: an entity that never armed a timer leaves the
// shard's timer map unmade.
func TestTimerNoCostWithout(t *testing.T) {
	f := &testFactory{}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, nil)
	h.Deliver(0, "a", req("a", "x"))
	rec.next(t)
	se := h.lookup(0)
	se.mu.Lock()
	defer se.mu.Unlock()
	if se.timers != nil {
		t.Fatal("a shard without timers has a timer map")
	}
}

// TestTimerRefusedInStop: a Stop hook cannot start a timer (it would
// outlive its incarnation), whatever stopped the entity.
func TestTimerRefusedInStop(t *testing.T) {
	var (
		h    *Host
		errs = make(chan error, 10)
	)
	f := &testFactory{
		handle: func(_ int, m *Message) ([]byte, error) {
			if string(m.Data) == "bye" {
				h.Passivate(m.Shard, m.EntityID)
			}
			return nil, nil
		},
		stop: func(int) error {
			errs <- h.StartTimer(0, "a", "late", time.Millisecond, false, nil)
			return nil
		},
	}
	rec := newRecorder()
	clock := hosttest.NewClock()
	h = newTestHost(t, f.factory, rec, func(c *Config) { c.IdleTimeout = time.Minute; c.Now = clock.Now })
	for _, stop := range []func(){
		func() { h.Deliver(0, "a", req("a", "bye")); rec.next(t) }, // the entity passivates itself
		func() { // idle
			h.Deliver(0, "a", req("a", "x"))
			rec.next(t)
			natstest.Eventually(t, 5*time.Second, "idle", func() bool { return quiet(h) })
			clock.Advance(time.Hour)
			h.PassivateIdle()
		},
		func() { h.Deliver(0, "a", req("a", "x")); rec.next(t); _ = h.StopShard(t.Context(), 0) }, // a handoff
	} {
		stop()
		select {
		case err := <-errs:
			if !errors.Is(err, ErrNotActive) {
				t.Fatalf("startTimer in Stop: %v, want ErrNotActive", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("no Stop")
		}
		natstest.Eventually(t, 5*time.Second, "entity removed", func() bool { return h.Active() == 0 })
	}
}

// inBubble runs f in a synctest bubble: time is fake, so that f sleeps
// past a timer's due time at once, and synctest.Wait returns once every
// goroutine of the test's host waits. The host's parked workers are
// reaped (after idleKeep, fake) before the bubble ends.
func inBubble(t *testing.T, f func(t *testing.T)) {
	synctest.Test(t, func(t *testing.T) {
		f(t)
		time.Sleep(3 * idleKeep)
	})
}
