package host

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
	"unsafe"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/internal/passivation"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region/internal/host/hosttest"
)

// ---- helpers ----

type captured struct {
	subject string
	data    []byte
	err     error
	refused string // the Natshard-Refused header: a refusal's reason
}

// answers is a Publisher that gives f each answer the host sends: its
// reply subject, data and error. An error answer's err has the text of
// the host's error, and errors.Is matches it to an error whose text ends
// it (the error wrapped last); a
// body the host made for an error without data is dropped (data nil).
type answers func(c captured)

func (f answers) Publish(subject string, data []byte) error {
	f(captured{subject: subject, data: slices.Clone(data)})
	return nil
}

func (f answers) PublishMsg(m *nats.Msg) error {
	c := captured{subject: m.Subject, err: answerErr(m.Header.Get(protocol.HeaderError)), refused: m.Header.Get(protocol.HeaderRefused)}
	if !bytes.Contains(m.Data, []byte(`"ok":false`)) {
		c.data = slices.Clone(m.Data)
	}
	f(c)
	return nil
}

func (answers) MaxPayload() int64 { return 1 << 20 }

// answerErr is an error answered in the Natshard-Error header.
type answerErr string

func (e answerErr) Error() string        { return string(e) }
func (e answerErr) Is(target error) bool { return strings.HasSuffix(string(e), target.Error()) }

// recorder captures the answers the host sends through conn.
type recorder struct{ ch chan captured }

func newRecorder() *recorder { return &recorder{ch: make(chan captured, 10000)} }

func (r *recorder) conn() Publisher { return answers(func(c captured) { r.ch <- c }) }

func (r *recorder) next(t *testing.T) captured {
	t.Helper()
	select {
	case c := <-r.ch:
		return c
	case <-time.After(5 * time.Second):
		t.Fatal("no reply within 5s")
		return captured{}
	}
}

func (r *recorder) none(t *testing.T) {
	t.Helper()
	select {
	case c := <-r.ch:
		t.Fatalf("unexpected reply %+v", c)
	default:
	}
}

func discardLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func req(id, data string) *nats.Msg {
	return &nats.Msg{Subject: "shard.t.0." + id, Reply: "_INBOX.x", Data: []byte(data)}
}

func pub(id, data string) *nats.Msg {
	return &nats.Msg{Subject: "shard.t.0." + id, Data: []byte(data)}
}

// quiet reports whether no cell of h has a goroutine or a pending stop.
func quiet(h *Host) bool {
	for se := range h.table.each() {
		se.mu.Lock()
		for _, c := range se.cells {
			if c.running || c.mailbox.len() > 0 {
				se.mu.Unlock()
				return false
			}
		}
		se.mu.Unlock()
	}
	return true
}

// testEntity records what happens to one incarnation.
type testEntity struct {
	inc    int
	handle func(inc int, m *Message) ([]byte, error)
	stop   func(inc int) error
}

func (e *testEntity) Handle(_ context.Context, m *Message) ([]byte, error) {
	if e.handle == nil {
		return m.Data, nil
	}
	return e.handle(e.inc, m)
}

func (e *testEntity) Stop(context.Context) error {
	if e.stop == nil {
		return nil
	}
	return e.stop(e.inc)
}

// testFactory counts its calls and numbers incarnations.
type testFactory struct {
	calls  atomic.Int32
	handle func(inc int, m *Message) ([]byte, error)
	stop   func(inc int) error
	fail   func(call int) error // nil: never fails
}

func (f *testFactory) factory(_ context.Context, _ string) (Entity, error) {
	n := int(f.calls.Add(1))
	if f.fail != nil {
		if err := f.fail(n); err != nil {
			return nil, err
		}
	}
	return &testEntity{inc: n, handle: f.handle, stop: f.stop}, nil
}

func newTestHost(t *testing.T, f Factory, rec *recorder, mod func(*Config)) *Host {
	t.Helper()
	cfg := Config{Factory: f, Logger: discardLogger(), Conn: rec.conn()}
	if mod != nil {
		mod(&cfg)
	}
	h := New(cfg)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = h.StopAll(ctx)
	})
	return h
}

// ---- tests ----

func TestHostOrderPerEntity(t *testing.T) {
	const n = 1000
	var (
		mu  sync.Mutex
		got []string
	)
	f := &testFactory{handle: func(_ int, m *Message) ([]byte, error) {
		mu.Lock()
		got = append(got, string(m.Data))
		mu.Unlock()
		return m.Data, nil
	}}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, nil)
	for i := range n {
		h.Deliver(0, "a", req("a", strconv.Itoa(i)))
	}
	for i := range n {
		if r := rec.next(t); string(r.data) != strconv.Itoa(i) || r.err != nil {
			t.Fatalf("reply %d = %q, %v; want %d", i, r.data, r.err, i)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for i, s := range got {
		if s != strconv.Itoa(i) {
			t.Fatalf("message %d handled as %s-th", i, s)
		}
	}
	if c := f.calls.Load(); c != 1 {
		t.Errorf("factory called %d times, want 1", c)
	}
}

func TestHostOneMessageAtATime(t *testing.T) {
	var inside, maxInside atomic.Int32
	f := &testFactory{handle: func(_ int, m *Message) ([]byte, error) {
		n := inside.Add(1)
		for {
			old := maxInside.Load()
			if n <= old || maxInside.CompareAndSwap(old, n) {
				break
			}
		}
		runtime.Gosched()
		inside.Add(-1)
		return nil, nil
	}}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, nil)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 200 {
				h.Deliver(0, "a", req("a", fmt.Sprint(g, i)))
			}
		})
	}
	wg.Wait()
	for range 800 {
		rec.next(t)
	}
	if m := maxInside.Load(); m != 1 {
		t.Fatalf("%d Handle calls ran at once on one entity", m)
	}
}

func TestHostConcurrentEntities(t *testing.T) {
	block := make(chan struct{})
	entered := make(chan struct{})
	f := &testFactory{handle: func(_ int, m *Message) ([]byte, error) {
		if m.EntityID == "a" {
			close(entered)
			<-block
		}
		return []byte(m.EntityID), nil
	}}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, nil)
	h.Deliver(0, "a", req("a", ""))
	<-entered
	h.Deliver(0, "b", req("b", "")) // same shard
	h.Deliver(1, "c", req("c", "")) // other shard
	got := map[string]bool{}
	for range 2 {
		got[string(rec.next(t).data)] = true
	}
	if !got["b"] || !got["c"] {
		t.Fatalf("replies while a is blocked: %v", got)
	}
	close(block)
	if r := rec.next(t); string(r.data) != "a" {
		t.Fatalf("reply %q, want a", r.data)
	}
}

// TestHostWorkersExit: the workers a burst started park when it is over,
// maxIdleWorkers of them at most (the others exit), and reap ends them: a
// worker parks for idleKeep to twice that (here, parked all at once, they
// are ended by the second reap, 2*idleKeep after they parked); the host
// starts workers again for its next burst. In a synctest bubble: the
// time is fake, each step is checked when every goroutine waits, and a
// worker that neither parks nor exits fails the test (the bubble ends
// deadlocked).
func TestHostWorkersExit(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const n = maxIdleWorkers + 16 // more than may park
		var (
			block   atomic.Pointer[chan struct{}]
			entered sync.WaitGroup
		)
		f := &testFactory{handle: func(_ int, m *Message) ([]byte, error) {
			entered.Done()
			<-*block.Load()
			return nil, nil
		}}
		rec := newRecorder()
		h := newTestHost(t, f.factory, rec, nil)
		parked := func() int {
			h.qmu.Lock()
			defer h.qmu.Unlock()
			return len(h.idle)
		}
		check := func(burst int, when string, want int) {
			t.Helper()
			synctest.Wait()
			if p := parked(); p != want {
				t.Fatalf("burst %d, %s: %d workers parked, want %d", burst, when, p, want)
			}
		}
		for burst := range 2 {
			ch := make(chan struct{})
			block.Store(&ch)
			entered.Add(n)
			for i := range n {
				h.Deliver(i, strconv.Itoa(i), req(strconv.Itoa(i), ""))
			}
			entered.Wait() // n entities in Handle at once: n workers
			close(ch)
			for range n {
				rec.next(t)
			}
			check(burst, "done", maxIdleWorkers)
			time.Sleep(2*idleKeep - time.Millisecond)
			check(burst, "just before the second reap", maxIdleWorkers)
			time.Sleep(time.Millisecond)
			check(burst, "after the second reap", 0)
		}
	})
}

func TestHostMessageFields(t *testing.T) {
	var seen Message // a copy: the *Message is valid during Handle only
	f := &testFactory{handle: func(_ int, m *Message) ([]byte, error) { seen = *m; return nil, nil }}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, nil)
	m := req("x.y", "data")
	m.Header = nats.Header{"K": []string{"v"}}
	h.Deliver(7, "x.y", m)
	rec.next(t)
	if seen.EntityID != "x.y" || seen.Shard != 7 || seen.Subject != m.Subject || seen.Reply != m.Reply ||
		string(seen.Data) != "data" || seen.Header.Get("K") != "v" {
		t.Fatalf("message = %+v", seen)
	}
}

func TestHostPublishErrorNotReplied(t *testing.T) {
	done := make(chan struct{}, 1)
	f := &testFactory{handle: func(_ int, m *Message) ([]byte, error) {
		done <- struct{}{}
		return []byte("x"), errors.New("bad")
	}}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, nil)
	h.Deliver(0, "a", pub("a", ""))
	<-done
	natstest.Eventually(t, 5*time.Second, "idle", func() bool { return quiet(h) })
	rec.none(t)

	h.Deliver(0, "a", req("a", ""))
	if r := rec.next(t); r.err == nil || r.err.Error() != "bad" || string(r.data) != "x" {
		t.Fatalf("reply = %+v", r)
	}
}

func TestHostPassivation(t *testing.T) {
	clock := hosttest.NewClock()
	var stops atomic.Int32
	f := &testFactory{
		handle: func(inc int, m *Message) ([]byte, error) { return []byte(strconv.Itoa(inc)), nil },
		stop:   func(int) error { stops.Add(1); return nil },
	}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, func(c *Config) {
		c.IdleTimeout = time.Minute
		c.Now = clock.Now
	})
	h.Deliver(0, "a", req("a", ""))
	if r := rec.next(t); string(r.data) != "1" {
		t.Fatalf("reply %q, want incarnation 1", r.data)
	}
	natstest.Eventually(t, 5*time.Second, "idle", func() bool { return quiet(h) })

	clock.Advance(59 * time.Second)
	if n := h.PassivateIdle(); n != 0 {
		t.Fatalf("passivateIdle before the timeout = %d", n)
	}
	clock.Advance(time.Second)
	if n := h.PassivateIdle(); n != 1 {
		t.Fatalf("passivateIdle = %d, want 1", n)
	}
	natstest.Eventually(t, 5*time.Second, "entity removed", func() bool { return h.Active() == 0 })
	if s := stops.Load(); s != 1 {
		t.Fatalf("Stop called %d times, want 1", s)
	}
	if n := h.PassivateIdle(); n != 0 {
		t.Fatalf("second passivateIdle = %d", n)
	}
	if s := stops.Load(); s != 1 {
		t.Fatalf("Stop called %d times, want 1", s)
	}

	h.Deliver(0, "a", req("a", ""))
	if r := rec.next(t); string(r.data) != "2" {
		t.Fatalf("reply %q, want incarnation 2", r.data)
	}
	if c := f.calls.Load(); c != 2 {
		t.Fatalf("factory called %d times, want 2", c)
	}
}

func TestHostPassivationDisabled(t *testing.T) {
	clock := hosttest.NewClock()
	f := &testFactory{}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, func(c *Config) { c.Now = clock.Now })
	h.Deliver(0, "a", req("a", ""))
	rec.next(t)
	clock.Advance(1000 * time.Hour)
	if n := h.PassivateIdle(); n != 0 || h.Active() != 1 {
		t.Fatalf("passivateIdle = %d, active = %d with IdleTimeout 0", n, h.Active())
	}
}

func TestHostPassivationSkipsBusyEntity(t *testing.T) {
	clock := hosttest.NewClock()
	block := make(chan struct{})
	entered := make(chan struct{}, 1)
	var stops atomic.Int32
	f := &testFactory{
		handle: func(_ int, m *Message) ([]byte, error) {
			if m.EntityID == "busy" {
				entered <- struct{}{}
				<-block
			}
			return nil, nil
		},
		stop: func(int) error { stops.Add(1); return nil },
	}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, func(c *Config) {
		c.IdleTimeout = time.Minute
		c.Now = clock.Now
	})
	h.Deliver(0, "idle", req("idle", ""))
	rec.next(t)
	// The answer goes before the worker marks the cell idle: wait for
	// that, or passivateIdle may find it still running.
	natstest.Eventually(t, 5*time.Second, "idle", func() bool { return quiet(h) })
	h.Deliver(0, "busy", req("busy", ""))
	<-entered
	clock.Advance(time.Hour)
	if n := h.PassivateIdle(); n != 1 {
		t.Fatalf("passivateIdle = %d, want 1 (only the idle entity)", n)
	}
	natstest.Eventually(t, 5*time.Second, "idle entity removed", func() bool { return h.Active() == 1 })
	if ids := h.Entities(0); !slices.Equal(ids, []string{"busy"}) {
		t.Fatalf("entities = %v", ids)
	}
	close(block)
	rec.next(t)
	if s := stops.Load(); s != 1 {
		t.Fatalf("Stop called %d times", s)
	}
}

func TestHostMessageDuringStop(t *testing.T) {
	clock := hosttest.NewClock()
	var (
		mu     sync.Mutex
		events []string
	)
	logEvent := func(s string) {
		mu.Lock()
		events = append(events, s)
		mu.Unlock()
	}
	stopEntered := make(chan struct{})
	releaseStop := make(chan struct{})
	f := &testFactory{
		handle: func(inc int, m *Message) ([]byte, error) {
			logEvent(fmt.Sprintf("handle %s by %d", m.Data, inc))
			return []byte(strconv.Itoa(inc)), nil
		},
		stop: func(inc int) error {
			logEvent(fmt.Sprintf("stop %d begin", inc))
			if inc == 1 {
				close(stopEntered)
				<-releaseStop
			}
			logEvent(fmt.Sprintf("stop %d end", inc))
			return nil
		},
	}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, func(c *Config) {
		c.IdleTimeout = time.Minute
		c.Now = clock.Now
	})
	h.Deliver(0, "a", req("a", "m1"))
	rec.next(t)
	natstest.Eventually(t, 5*time.Second, "idle", func() bool { return quiet(h) })
	clock.Advance(time.Minute)
	if n := h.PassivateIdle(); n != 1 {
		t.Fatalf("passivateIdle = %d", n)
	}
	<-stopEntered
	h.Deliver(0, "a", req("a", "m2"))
	h.Deliver(0, "a", req("a", "m3"))
	rec.none(t)
	close(releaseStop)
	for _, want := range []string{"2", "2"} {
		if r := rec.next(t); string(r.data) != want {
			t.Fatalf("reply by incarnation %s, want %s", r.data, want)
		}
	}
	mu.Lock()
	got := slices.Clone(events)
	mu.Unlock()
	want := []string{"handle m1 by 1", "stop 1 begin", "stop 1 end", "handle m2 by 2", "handle m3 by 2"}
	if !slices.Equal(got, want) {
		t.Fatalf("events = %q\nwant %q", got, want)
	}
	if c := f.calls.Load(); c != 2 || h.Active() != 1 {
		t.Fatalf("factory calls = %d, active = %d", c, h.Active())
	}
}

func TestHostPassivationCancelledByDelivery(t *testing.T) {
	var stops atomic.Int32
	f := &testFactory{
		handle: func(inc int, m *Message) ([]byte, error) { return []byte(strconv.Itoa(inc)), nil },
		stop:   func(int) error { stops.Add(1); return nil },
	}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, func(c *Config) { c.IdleTimeout = time.Minute })
	h.Deliver(0, "a", req("a", ""))
	rec.next(t)
	natstest.Eventually(t, 5*time.Second, "idle", func() bool { return quiet(h) })

	// Queue a passivation by hand, as passivateIdle does, but deliver a
	// message before its Stop begins.
	se := h.lookup(0)
	se.mu.Lock()
	c := se.cells["a"]
	c.running, c.stop = true, stopQueued
	se.mu.Unlock()
	h.Deliver(0, "a", req("a", ""))
	h.stopCell(stopItem{se: se, id: "a", c: c})

	if r := rec.next(t); string(r.data) != "1" {
		t.Fatalf("reply by incarnation %s, want 1 (passivation cancelled)", r.data)
	}
	natstest.Eventually(t, 5*time.Second, "idle", func() bool { return quiet(h) })
	if s := stops.Load(); s != 0 {
		t.Fatalf("Stop called %d times, want 0", s)
	}
}

func TestHostStopShardWaitsForQueued(t *testing.T) {
	var (
		mu     sync.Mutex
		events []string
	)
	logEvent := func(s string) {
		mu.Lock()
		events = append(events, s)
		mu.Unlock()
	}
	entered := make(chan struct{})
	block := make(chan struct{})
	f := &testFactory{
		handle: func(_ int, m *Message) ([]byte, error) {
			logEvent("handle " + m.EntityID + " " + string(m.Data))
			if string(m.Data) == "m1" {
				close(entered)
				<-block
			}
			return nil, nil
		},
		stop: func(inc int) error { logEvent(fmt.Sprintf("stop %d", inc)); return nil },
	}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, nil)
	h.Deliver(3, "idle", pub("idle", "x")) // incarnation 1, idle when the stop begins
	natstest.Eventually(t, 5*time.Second, "idle entity", func() bool { return quiet(h) && h.Active() == 1 })
	h.Deliver(5, "other", pub("other", "x")) // another shard: not stopped
	natstest.Eventually(t, 5*time.Second, "other entity", func() bool { return quiet(h) && h.Active() == 2 })

	h.Deliver(3, "a", pub("a", "m1")) // incarnation 3
	<-entered
	h.Deliver(3, "a", pub("a", "m2"))
	h.Deliver(3, "a", pub("a", "m3"))

	done := make(chan error, 1)
	go func() { done <- h.StopShard(context.Background(), 3) }()
	natstest.Eventually(t, 5*time.Second, "shard closing", func() bool {
		se := h.lookup(3)
		se.mu.Lock()
		defer se.mu.Unlock()
		return se.closing
	})
	h.Deliver(3, "a", req("a", "late"))
	h.Deliver(3, "new", req("new", "late"))
	for range 2 {
		if r := rec.next(t); !errors.Is(r.err, errShardNotServed) || r.err.Error() != "shard not served here" {
			t.Fatalf("late message answered %+v", r)
		}
	}
	select {
	case err := <-done:
		t.Fatalf("stopShard returned %v while a message was being handled", err)
	case <-time.After(20 * time.Millisecond):
	}
	close(block)
	if err := <-done; err != nil {
		t.Fatalf("stopShard: %v", err)
	}
	mu.Lock()
	got := slices.Clone(events)
	mu.Unlock()
	// The idle entity may stop at any point; check the busy one's order.
	var busy []string
	for _, e := range got {
		if e != "handle idle x" && e != "stop 1" && e != "handle other x" {
			busy = append(busy, e)
		}
	}
	if want := []string{"handle a m1", "handle a m2", "handle a m3", "stop 3"}; !slices.Equal(busy, want) {
		t.Fatalf("events = %q, want %q", busy, want)
	}
	if !slices.Contains(got, "stop 1") || slices.Contains(got, "stop 2") {
		t.Fatalf("events = %q: want the idle entity stopped, the other shard's not", got)
	}
	if ids := h.Entities(3); len(ids) != 0 {
		t.Fatalf("shard 3 still holds %v", ids)
	}
	if h.Active() != 1 {
		t.Fatalf("active = %d, want 1", h.Active())
	}
	// Bound again later: the shard starts afresh.
	h.Deliver(3, "a", req("a", "again"))
	if r := rec.next(t); r.err != nil {
		t.Fatalf("after the stop: %v", r.err)
	}
}

func TestHostStopShardEmpty(t *testing.T) {
	f := &testFactory{}
	h := newTestHost(t, f.factory, newRecorder(), nil)
	if err := h.StopShard(context.Background(), 9); err != nil {
		t.Fatal(err)
	}
	h.Deliver(9, "a", pub("a", ""))
	natstest.Eventually(t, 5*time.Second, "idle", func() bool { return quiet(h) })
	if err := h.StopShard(context.Background(), 9); err != nil {
		t.Fatal(err)
	}
	if h.Active() != 0 || len(slices.Collect(h.table.each())) != 0 {
		t.Fatalf("active = %d, shards = %d", h.Active(), len(slices.Collect(h.table.each())))
	}
}

func TestHostStopShardContext(t *testing.T) {
	block := make(chan struct{})
	defer close(block)
	entered := make(chan struct{})
	f := &testFactory{handle: func(_ int, m *Message) ([]byte, error) {
		close(entered)
		<-block
		return nil, nil
	}}
	h := newTestHost(t, f.factory, newRecorder(), nil)
	h.Deliver(0, "a", pub("a", ""))
	<-entered
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	if err := h.StopShard(ctx, 0); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("stopShard = %v, want deadline exceeded", err)
	}
}

func TestHostStopTimeoutAbandonsHook(t *testing.T) {
	hang := make(chan struct{})
	defer close(hang)
	f := &testFactory{stop: func(int) error { <-hang; return nil }}
	h := newTestHost(t, f.factory, newRecorder(), func(c *Config) { c.StopTimeout = 20 * time.Millisecond })
	h.Deliver(0, "a", pub("a", ""))
	natstest.Eventually(t, 5*time.Second, "idle", func() bool { return quiet(h) && h.Active() == 1 })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := h.StopShard(ctx, 0); err != nil {
		t.Fatalf("stopShard with a hanging Stop hook: %v", err)
	}
}

func TestHostStopAll(t *testing.T) {
	var stops atomic.Int32
	f := &testFactory{stop: func(int) error { stops.Add(1); return nil }}
	h := newTestHost(t, f.factory, newRecorder(), nil)
	for i := range 50 {
		id := "e" + strconv.Itoa(i)
		h.Deliver(i%7, id, pub(id, ""))
	}
	natstest.Eventually(t, 5*time.Second, "idle", func() bool { return quiet(h) && h.Active() == 50 })
	if err := h.StopAll(context.Background()); err != nil {
		t.Fatal(err)
	}
	if h.Active() != 0 || stops.Load() != 50 {
		t.Fatalf("active = %d, stops = %d", h.Active(), stops.Load())
	}
}

func TestHostShardEntitiesSorted(t *testing.T) {
	f := &testFactory{}
	h := newTestHost(t, f.factory, newRecorder(), nil)
	for _, id := range []string{"c", "a", "b"} {
		h.Deliver(2, id, pub(id, ""))
	}
	h.Deliver(1, "z", pub("z", ""))
	natstest.Eventually(t, 5*time.Second, "idle", func() bool { return quiet(h) && h.Active() == 4 })
	if ids := h.Entities(2); !slices.Equal(ids, []string{"a", "b", "c"}) {
		t.Fatalf("shardEntities(2) = %v", ids)
	}
	if ids := h.Entities(4); len(ids) != 0 {
		t.Fatalf("shardEntities(4) = %v", ids)
	}
}

func TestHostFactoryErrorRetried(t *testing.T) {
	f := &testFactory{fail: func(call int) error {
		if call == 1 {
			return errors.New("state unavailable")
		}
		return nil
	}}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, nil)
	h.Deliver(0, "a", req("a", "one"))
	r := rec.next(t)
	if r.err == nil || r.data != nil {
		t.Fatalf("first reply = %+v, want the factory error", r)
	}
	if want := "create entity: state unavailable"; r.err.Error() != want {
		t.Fatalf("error %q, want %q", r.err, want)
	}
	natstest.Eventually(t, 5*time.Second, "failed cell removed", func() bool { return quiet(h) && h.Active() == 0 })

	h.Deliver(0, "a", req("a", "two"))
	if r := rec.next(t); r.err != nil || string(r.data) != "two" {
		t.Fatalf("second reply = %+v", r)
	}
	if c := f.calls.Load(); c != 2 {
		t.Fatalf("factory called %d times, want 2", c)
	}
}

func TestHostFactoryErrorRetriedWithinMailbox(t *testing.T) {
	gate := make(chan struct{})
	f := &testFactory{fail: func(call int) error {
		if call == 1 {
			<-gate // let the second message queue up behind the first
			return errors.New("boom")
		}
		return nil
	}}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, nil)
	h.Deliver(0, "a", req("a", "one"))
	h.Deliver(0, "a", req("a", "two"))
	close(gate)
	if r := rec.next(t); r.err == nil {
		t.Fatalf("first reply = %+v", r)
	}
	if r := rec.next(t); r.err != nil || string(r.data) != "two" {
		t.Fatalf("second reply = %+v", r)
	}
}

func TestHostPanicRecovered(t *testing.T) {
	logs := &natstest.Buffer{}
	var stops atomic.Int32
	f := &testFactory{
		handle: func(inc int, m *Message) ([]byte, error) {
			if string(m.Data) == "boom" {
				panic("kaboom")
			}
			return []byte(strconv.Itoa(inc)), nil
		},
		stop: func(int) error { stops.Add(1); return nil },
	}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, func(c *Config) {
		c.Logger = slog.New(slog.NewTextHandler(logs, nil))
	})
	h.Deliver(0, "a", req("a", "x"))
	h.Deliver(0, "a", req("a", "boom"))
	h.Deliver(0, "a", req("a", "y"))
	if r := rec.next(t); string(r.data) != "1" {
		t.Fatalf("reply %+v", r)
	}
	if r := rec.next(t); !errors.Is(r.err, errEntityPanicked) {
		t.Fatalf("panic answered %+v", r)
	}
	if r := rec.next(t); r.err != nil || string(r.data) != "2" {
		t.Fatalf("after the panic: %+v, want incarnation 2", r)
	}
	if s := stops.Load(); s != 0 {
		t.Fatalf("Stop of the panicked incarnation called %d times", s)
	}
	// A panicking publish is not answered, and the entity is dropped.
	h.Deliver(0, "a", pub("a", "boom"))
	natstest.Eventually(t, 5*time.Second, "panicked entity dropped", func() bool { return quiet(h) && h.Active() == 0 })
	rec.none(t)
	if s := logs.String(); !bytes.Contains([]byte(s), []byte("level=ERROR")) || !bytes.Contains([]byte(s), []byte("kaboom")) {
		t.Fatalf("panic not logged at error: %s", s)
	}
}

func TestHostFactoryAndStopPanicRecovered(t *testing.T) {
	clock := hosttest.NewClock()
	f := &testFactory{
		fail: func(call int) error {
			if call == 1 {
				panic("factory kaboom")
			}
			return nil
		},
		stop: func(int) error { panic("stop kaboom") },
	}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, func(c *Config) {
		c.IdleTimeout = time.Second
		c.Now = clock.Now
	})
	h.Deliver(0, "a", req("a", ""))
	if r := rec.next(t); !errors.Is(r.err, errEntityPanicked) {
		t.Fatalf("factory panic answered %+v", r)
	}
	h.Deliver(0, "a", req("a", "ok"))
	if r := rec.next(t); r.err != nil || string(r.data) != "ok" {
		t.Fatalf("after the factory panic: %+v", r)
	}
	natstest.Eventually(t, 5*time.Second, "idle", func() bool { return quiet(h) })
	clock.Advance(time.Second)
	if n := h.PassivateIdle(); n != 1 {
		t.Fatalf("passivateIdle = %d", n)
	}
	natstest.Eventually(t, 5*time.Second, "passivated despite the Stop panic", func() bool { return h.Active() == 0 })
	h.Deliver(0, "a", req("a", "again"))
	if r := rec.next(t); r.err != nil {
		t.Fatalf("after the Stop panic: %+v", r)
	}
}

// TestHostStress delivers requests to many entities from several
// goroutines while passivation sweeps run, then checks that every request
// was answered once, per-entity order held across incarnations, no two
// incarnations of an entity overlapped, and every incarnation was stopped
// exactly once.
func TestHostStress(t *testing.T) {
	const (
		senders   = 4
		perSender = 25 // entities owned by each sender
		msgs      = 3000
	)
	type track struct {
		mu      sync.Mutex
		live    int // live incarnation, 0 when none
		lastSeq int
	}
	var (
		tracks    sync.Map // id -> *track
		failures  atomic.Int32
		firstFail atomic.Value
		nextInc   atomic.Int32
		stops     atomic.Int32
	)
	fail := func(format string, args ...any) {
		if failures.Add(1) == 1 {
			firstFail.Store(fmt.Sprintf(format, args...))
		}
	}
	trackOf := func(id string) *track {
		v, _ := tracks.LoadOrStore(id, &track{})
		return v.(*track)
	}
	handle := func(id string, inc int, m *Message) ([]byte, error) {
		tr := trackOf(id)
		seq, _ := strconv.Atoi(string(m.Data))
		tr.mu.Lock()
		if tr.live != inc {
			fail("%s: message handled by incarnation %d while %d is live", id, inc, tr.live)
		}
		if seq <= tr.lastSeq {
			fail("%s: message %d after %d", id, seq, tr.lastSeq)
		}
		tr.lastSeq = seq
		tr.mu.Unlock()
		return m.Data, nil
	}
	factory := func(_ context.Context, id string) (Entity, error) {
		inc := int(nextInc.Add(1))
		tr := trackOf(id)
		tr.mu.Lock()
		if tr.live != 0 {
			fail("%s: incarnation %d created while %d is live", id, inc, tr.live)
		}
		tr.live = inc
		tr.mu.Unlock()
		return &stressEntity{handle: func(m *Message) ([]byte, error) {
			return handle(id, inc, m)
		}, stop: func() {
			stops.Add(1)
			tr.mu.Lock()
			if tr.live != inc {
				fail("%s: stop of incarnation %d while %d is live", id, inc, tr.live)
			}
			tr.live = 0
			tr.mu.Unlock()
		}}, nil
	}
	clock := hosttest.NewClock()
	var replies atomic.Int32
	h := New(Config{
		Factory:     factory,
		IdleTimeout: time.Second,
		Logger:      discardLogger(),
		Now:         clock.Now,
		Conn: answers(func(c captured) {
			if c.err != nil {
				fail("request answered on %s with %v", c.subject, c.err)
			}
			replies.Add(1)
		}),
	})
	done := make(chan struct{})
	var sweeper sync.WaitGroup
	sweeper.Go(func() {
		for {
			select {
			case <-done:
				return
			default:
			}
			clock.Advance(time.Second)
			h.PassivateIdle()
			runtime.Gosched()
		}
	})
	var wg sync.WaitGroup
	for s := range senders {
		wg.Go(func() {
			seq := make([]int, perSender)
			for i := range msgs {
				k := (i*7 + i/3) % perSender
				seq[k]++
				id := fmt.Sprintf("s%d-e%d", s, k)
				h.Deliver(k%5, id, req(id, strconv.Itoa(seq[k])))
				if i%64 == 0 {
					runtime.Gosched()
				}
			}
		})
	}
	wg.Wait()
	natstest.Eventually(t, 5*time.Second, "all answered", func() bool { return replies.Load() == senders*msgs })
	close(done)
	sweeper.Wait()
	if err := h.StopAll(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := failures.Load(); n > 0 {
		t.Fatalf("%d failures, first: %s", n, firstFail.Load())
	}
	if c, s := nextInc.Load(), stops.Load(); c != s {
		t.Fatalf("%d incarnations, %d stops", c, s)
	}
	t.Logf("%d messages, %d incarnations", senders*msgs, nextInc.Load())
}

// stressEntity is the entity of TestHostStress.
type stressEntity struct {
	handle func(*Message) ([]byte, error)
	stop   func()
}

func (e *stressEntity) Handle(_ context.Context, m *Message) ([]byte, error) { return e.handle(m) }
func (e *stressEntity) Stop(context.Context) error                           { e.stop(); return nil }

// nopEntity is the trivial entity of the memory test: no user state.
type nopEntity struct{}

func (nopEntity) Handle(context.Context, *Message) ([]byte, error) { return nil, nil }
func (nopEntity) Stop(context.Context) error                       { return nil }

func TestHostMemoryPerIdleEntity(t *testing.T) {
	const (
		n      = 100_000
		shards = 128
		batch  = 1000 // the race detector allows 8128 live goroutines
	)
	var handled atomic.Int64
	f := func(context.Context, string) (Entity, error) { return nopEntity{}, nil }
	h := New(Config{
		Factory: f,
		Logger:  discardLogger(),
		Conn:    answers(func(captured) { handled.Add(1) }),
	})
	measure := func() uint64 {
		runtime.GC()
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	before := measure()
	for i := 0; i < n; i += batch {
		for j := i; j < i+batch; j++ {
			id := "entity-" + strconv.Itoa(j)
			h.Deliver(j%shards, id, &nats.Msg{Subject: "shard.t." + strconv.Itoa(j%shards) + "." + id, Reply: "r"})
		}
		for handled.Load() < int64(i+batch) {
			time.Sleep(100 * time.Microsecond)
		}
	}
	natstest.Eventually(t, 5*time.Second, "all idle", func() bool { return quiet(h) })
	after := measure()
	if a := h.Active(); a != n {
		t.Fatalf("active = %d, want %d", a, n)
	}
	per := float64(int64(after)-int64(before)) / n
	t.Logf("memory per idle entity: %.0f bytes (%d entities in %d shards, heap %d -> %d)", per, n, shards, before, after)
	if per > 1024 {
		t.Fatalf("%.0f bytes per idle entity, want <= 1024", per)
	}
	runtime.KeepAlive(h)
}

// TestHostEntityContext: the Factory and Handle of a shard's entities get
// its context, which a handoff's stop ends only once the entities have
// stopped (so that they finish what they were given), and abortShard (a
// drop or a fence) ends at once; other shards keep theirs.
func TestHostEntityContext(t *testing.T) {
	type seen struct {
		shard int
		ctx   context.Context
	}
	ctxs := make(chan seen, 10)
	block := make(chan struct{})
	factory := func(ctx context.Context, id string) (Entity, error) {
		shard, _ := strconv.Atoi(id)
		ctxs <- seen{shard, ctx}
		return &testEntity{handle: func(_ int, m *Message) ([]byte, error) {
			if string(m.Data) == "block" {
				<-block
			}
			return nil, nil
		}}, nil
	}
	h := newTestHost(t, factory, newRecorder(), nil)
	for shard := range 3 {
		h.Deliver(shard, strconv.Itoa(shard), pub(strconv.Itoa(shard), "x"))
	}
	got := map[int]context.Context{}
	for range 3 {
		s := <-ctxs
		got[s.shard] = s.ctx
	}
	h.Deliver(0, "0", pub("0", "block"))
	natstest.Eventually(t, 5*time.Second, "shard 0 busy", func() bool { return !quiet(h) })

	// A handoff's stop: the context lives while an entity still works.
	stopped := make(chan error, 1)
	go func() { stopped <- h.StopShard(context.Background(), 0) }()
	natstest.Eventually(t, 5*time.Second, "shard 0 closing", func() bool {
		se := h.lookup(0)
		se.mu.Lock()
		defer se.mu.Unlock()
		return se.closing
	})
	if err := got[0].Err(); err != nil {
		t.Fatalf("shard 0's context ended while its entity still worked: %v", err)
	}
	close(block)
	if err := <-stopped; err != nil {
		t.Fatal(err)
	}
	if got[0].Err() == nil {
		t.Fatal("shard 0's context lives on after its entities stopped")
	}

	// A drop or fence: at once, and only the shard's.
	h.AbortShard(1)
	if got[1].Err() == nil {
		t.Fatal("abortShard(1) left shard 1's context alive")
	}
	if err := got[2].Err(); err != nil {
		t.Fatalf("shard 2's context ended with shard 1's: %v", err)
	}
}

// TestHostDurableRetriesUnavailable: in durable delivery, a message whose
// entity (or its Factory) fails with ErrUnavailable is given again, in
// place (before the entity's later messages), and acknowledged once
// handled; one that fails otherwise is answered and acknowledged; one
// still failing when its shard leaves is neither.
func TestHostDurableRetriesUnavailable(t *testing.T) {
	var fails atomic.Int32
	fails.Store(2)
	var mu sync.Mutex
	var order []string
	f := &testFactory{
		fail: func(int) error {
			if fails.Add(-1) >= 0 {
				return fmt.Errorf("load state: %w", kvstate.ErrUnavailable)
			}
			return nil
		},
		handle: func(_ int, m *Message) ([]byte, error) {
			mu.Lock()
			order = append(order, string(m.Data))
			mu.Unlock()
			if string(m.Data) == "bad" {
				return nil, errors.New("bad request")
			}
			return m.Data, nil
		},
	}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, nil)
	done := make(chan string, 10)
	h.DeliverDurable(0, "a", req("a", "first"), 1, func() { done <- "first" })
	h.DeliverDurable(0, "a", req("a", "bad"), 2, func() { done <- "bad" })
	for _, want := range []string{"first", "bad"} {
		select {
		case got := <-done:
			if got != want {
				t.Fatalf("done %q, want %q", got, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%q never done", want)
		}
	}
	if r := rec.next(t); string(r.data) != "first" || r.err != nil {
		t.Fatalf("first answered %+v, want its data once the factory worked", r)
	}
	if r := rec.next(t); r.err == nil || r.err.Error() != "bad request" {
		t.Fatalf("bad answered %+v, want the entity's error", r)
	}
	rec.none(t)
	if got := f.calls.Load(); got != 3 {
		t.Fatalf("factory called %d times, want 3 (two failures, then an entity)", got)
	}
	mu.Lock()
	if fmt.Sprint(order) != "[first bad]" {
		t.Fatalf("handled %v", order)
	}
	mu.Unlock()

	// Unavailable until the shard leaves: neither answered nor done.
	var tries atomic.Int32
	f.handle = func(int, *Message) ([]byte, error) {
		tries.Add(1)
		return nil, fmt.Errorf("save: %w", kvstate.ErrUnavailable)
	}
	h.DeliverDurable(1, "b", req("b", "stuck"), 3, func() { done <- "stuck" })
	natstest.Eventually(t, 10*time.Second, "the stuck message given 3 times", func() bool { return tries.Load() >= 3 })
	h.AbortShard(1)
	if err := h.StopShard(context.Background(), 1); err != nil {
		t.Fatal(err)
	}
	select {
	case got := <-done:
		t.Fatalf("%q done though never handled", got)
	default:
	}
	rec.none(t)
}

// TestHostActiveLimitLRU: beyond MaxActive, with the LRU policy, the
// least recently used idle entities are passivated; a busy one never is,
// and one used again since keeps its place.
func TestHostActiveLimitLRU(t *testing.T) {
	clock := hosttest.NewClock()
	block := make(chan struct{})
	entered := make(chan struct{}, 1)
	var mu sync.Mutex
	var stopped []int // incarnations, in the order their Stop ran
	f := &testFactory{
		handle: func(_ int, m *Message) ([]byte, error) {
			if m.EntityID == "busy" {
				entered <- struct{}{}
				<-block
			}
			return nil, nil
		},
		stop: func(inc int) error { mu.Lock(); stopped = append(stopped, inc); mu.Unlock(); return nil },
	}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, func(c *Config) {
		c.MaxActive = 3
		c.Passivation = passivation.LRU
		c.Now = clock.Now
	})
	// Busy first (the least recently used of all), then e1..e5, one
	// second apart, in two shards; e1 is used again last.
	h.Deliver(0, "busy", req("busy", ""))
	<-entered
	for i := 1; i <= 5; i++ {
		clock.Advance(time.Second)
		id := fmt.Sprintf("e%d", i)
		h.Deliver(i%2, id, req(id, ""))
		rec.next(t)
	}
	clock.Advance(time.Second)
	h.Deliver(1, "e1", req("e1", ""))
	rec.next(t)
	natstest.Eventually(t, 5*time.Second, "idle", func() bool { return h.Active() == 6 && f.calls.Load() == 6 })
	natstest.Eventually(t, 5*time.Second, "only busy runs", func() bool {
		n := 0
		for se := range h.table.each() {
			se.mu.Lock()
			for _, c := range se.cells {
				if c.running {
					n++
				}
			}
			se.mu.Unlock()
		}
		return n == 1
	})

	// 6 held, limit 3: the three least recently used idle ones go (e2, e3,
	// e4), not busy (older, but busy), not e1 (used again).
	if n := h.PassivateOverLimit(); n != 3 {
		t.Fatalf("passivateOverLimit = %d, want 3", n)
	}
	natstest.Eventually(t, 5*time.Second, "three stopped", func() bool { return h.Active() == 3 })
	got := append(h.Entities(0), h.Entities(1)...)
	slices.Sort(got)
	if want := []string{"busy", "e1", "e5"}; !slices.Equal(got, want) {
		t.Fatalf("entities left %v, want %v", got, want)
	}
	if n := h.PassivateOverLimit(); n != 0 {
		t.Fatalf("at the limit, passivateOverLimit = %d", n)
	}
	if c := h.overLimit.Load(); c != 3 {
		t.Fatalf("overLimit = %d, want 3", c)
	}
	mu.Lock()
	if len(stopped) != 3 {
		t.Fatalf("Stop ran for incarnations %v, want 3 of them", stopped)
	}
	mu.Unlock()
	close(block)
	rec.next(t)
}

// TestHostActiveLimitCountsTheNextIncarnation: a message that reaches an
// entity while its Stop for the limit runs goes to a new incarnation,
// which the limit's policy counts again at once (its entry was detached
// when it was chosen): the region, over the limit again, passivates one.
// A touch kept for later (touchBatch) would be dropped as detached. Then
// the same with a check during the Stop that detaches the entry again
// after that message's touch: the new incarnation is counted all the same.
func TestHostActiveLimitCountsTheNextIncarnation(t *testing.T) {
	for _, checkDuringStop := range []bool{false, true} {
		t.Run(fmt.Sprintf("check during stop=%v", checkDuringStop), func(t *testing.T) {
			testLimitCountsNextIncarnation(t, checkDuringStop)
		})
	}
}

func testLimitCountsNextIncarnation(t *testing.T, checkDuringStop bool) {
	stopping, release := make(chan int, 1), make(chan struct{})
	f := &testFactory{stop: func(inc int) error {
		if inc == 1 {
			stopping <- inc
			<-release
		}
		return nil
	}}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, func(c *Config) {
		c.MaxActive = 1
		c.Passivation = passivation.LRU
	})
	for _, id := range []string{"a", "b"} { // a is the least recently used
		h.Deliver(0, id, req(id, ""))
		rec.next(t)
	}
	natstest.Eventually(t, 5*time.Second, "idle", func() bool { return quiet(h) })
	if n := h.PassivateOverLimit(); n != 1 {
		t.Fatalf("passivateOverLimit = %d, want 1", n)
	}
	<-stopping // a's Stop runs
	h.Deliver(0, "a", req("a", "again"))
	if checkDuringStop {
		// b used after a: the check chooses a's entry (attached again by
		// its message) and leaves it detached, a being stopped.
		h.Deliver(0, "b", req("b", ""))
		rec.next(t)
		if n := h.PassivateOverLimit(); n != 0 {
			t.Fatalf("a check during a's Stop started %d stops", n)
		}
	}
	close(release)
	rec.next(t)
	natstest.Eventually(t, 5*time.Second, "a's next incarnation idle", func() bool { return quiet(h) && h.Active() == 2 })
	for range 3 { // messages whose touches wait for the next check
		h.Deliver(0, "a", req("a", "more"))
		rec.next(t)
	}
	natstest.Eventually(t, 5*time.Second, "idle again", func() bool { return quiet(h) })
	if n := h.PassivateOverLimit(); n != 1 {
		t.Fatalf("over the limit again: passivateOverLimit = %d, want 1", n)
	}
	h.limitMu.Lock()
	held := h.limit.Len()
	h.limitMu.Unlock()
	if held != 1 || h.Active() > 2 {
		t.Fatalf("after the check: the limit's policy holds %d entities (want 1), %d active", held, h.Active())
	}
}

// TestHostActiveLimitOff: without MaxActive nothing is passivated for it.
func TestHostActiveLimitOff(t *testing.T) {
	f := &testFactory{}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, nil)
	for i := range 10 {
		id := fmt.Sprintf("e%d", i)
		h.Deliver(0, id, req(id, ""))
		rec.next(t)
	}
	if n := h.PassivateOverLimit(); n != 0 || h.Active() != 10 {
		t.Fatalf("passivateOverLimit = %d, active = %d, with no limit", n, h.Active())
	}
}

// TestHostActiveLimitWTinyLFU: with the default policy, an entity used
// often stays active while a scan of entities used once passes through
// the limit; with LRU the scan passivates it. Each scan entity's message
// is followed by the check the region runs every 100 ms.
func TestHostActiveLimitWTinyLFU(t *testing.T) {
	for _, tc := range []struct {
		policy  string
		hotKept bool
	}{{"", true}, {passivation.LRU, false}} {
		t.Run(cmp.Or(tc.policy, "default"), func(t *testing.T) {
			f := &testFactory{}
			rec := newRecorder()
			h := newTestHost(t, f.factory, rec, func(c *Config) {
				c.MaxActive = 10 // W-TinyLFU: a window of 1, a main area of 9
				c.Passivation = tc.policy
			})
			send := func(shard int, id string) {
				t.Helper()
				h.Deliver(shard, id, req(id, ""))
				rec.next(t)
			}
			for range 5 {
				send(0, "hot")
			}
			for i := 1; i <= 9; i++ {
				send(i%2, fmt.Sprintf("e%d", i))
			}
			for i := range 30 {
				send(i%2, fmt.Sprintf("scan%d", i))
				natstest.Eventually(t, 5*time.Second, "idle", func() bool { return quiet(h) })
				if n := h.PassivateOverLimit(); n != 1 {
					t.Fatalf("scan %d: passivateOverLimit = %d, want 1", i, n)
				}
				natstest.Eventually(t, 5*time.Second, "at the limit", func() bool { return h.Active() == 10 && quiet(h) })
			}
			if kept := slices.Contains(h.Entities(0), "hot"); kept != tc.hotKept {
				t.Fatalf("hot entity active after the scan: %v, want %v (shard 0 holds %v)", kept, tc.hotKept, h.Entities(0))
			}
			if c := h.overLimit.Load(); c != 30 {
				t.Fatalf("overLimit = %d, want 30", c)
			}
		})
	}
}

// TestHostCellSize: an idle entity's cell is 48 bytes (its size class:
// what the docs give per idle entity rests on it), the limit's entry
// included as a pointer, and 48 bytes more with MaxActive (the policy's
// entry).
func TestHostCellSize(t *testing.T) {
	if n := unsafe.Sizeof(cell{}); n > 48 {
		t.Errorf("cell is %d bytes, more than the 48 the docs give", n)
	}
	if n := unsafe.Sizeof(limitEntry{}); n > 48 {
		t.Errorf("limitEntry is %d bytes, more than 48", n)
	}
}

// TestHostShardCostFlat: what a host allocates to take a new shard does
// not grow with the shards it holds. The lookup table it replaced was a
// copy of a map per change, O(shards held) (BenchmarkTakeShards times
// both; docs/BENCHMARKS.md). Bytes, not time, so that the test is
// deterministic.
func TestHostShardCostFlat(t *testing.T) {
	h := New(Config{Factory: benchFactory, Logger: discardLogger()})
	allocated := func(from, to int) uint64 {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		for n := from; n < to; n++ {
			if h.shardFor(n) != h.lookup(n) {
				t.Fatalf("lookup(%d) is not the shard shardFor made", n)
			}
		}
		runtime.ReadMemStats(&after)
		return (after.TotalAlloc - before.TotalAlloc) / uint64(to-from)
	}
	first := allocated(0, 1000)
	h.shardFor(protocol.MaxShards - 1) // pages at both ends
	_ = allocated(1000, 20_000)
	last := allocated(20_000, 21_000)
	t.Logf("bytes per new shard: %d with 0 - 1 000 held, %d with 20 000 - 21 000", first, last)
	if last > 2*first+4096 {
		t.Fatalf("a new shard costs %d bytes with 20 000 held, %d with none: the cost grows with the shards held", last, first)
	}
	if h.lookup(-1) != nil || h.lookup(protocol.MaxShards) != nil || h.lookup(30_000) != nil {
		t.Fatal("lookup found a shard out of range or never taken")
	}
}

// TestHostQueuedAfterStall: after a stall, a message queued before it
// (its shard may be another region's by then) waits while its shard is
// held (HoldShard) and is handled once the region confirms the shard
// (ReleaseShard, or a stop as the region's), in order; it is dropped
// unanswered if the shard is aborted (its next holder may answer a copy),
// refused if it was not held for that stall.
func TestHostQueuedAfterStall(t *testing.T) {
	const handled, refused, dropped = "handled", "refused", "dropped"
	for _, c := range []struct {
		name    string
		hold    bool
		end     func(h *Host)
		outcome string // of the messages queued before the stall
	}{
		{"released", true, func(h *Host) { h.ReleaseShard(0) }, handled},
		{"stopped", true, func(h *Host) { _ = h.StopShard(context.Background(), 0) }, handled},
		{"aborted", true, func(h *Host) { h.AbortShard(0) }, dropped},
		{"not held", false, func(*Host) {}, refused},
	} {
		t.Run(c.name, func(t *testing.T) {
			var stalls atomic.Uint64
			gate, entered := make(chan struct{}), make(chan struct{})
			var mu sync.Mutex
			var got []string
			f := &testFactory{handle: func(_ int, m *Message) ([]byte, error) {
				if string(m.Data) == "first" {
					close(entered)
					<-gate
				}
				mu.Lock()
				got = append(got, string(m.Data))
				mu.Unlock()
				return m.Data, nil
			}}
			rec := newRecorder()
			h := newTestHost(t, f.factory, rec, func(cfg *Config) { cfg.Stalls = func(bool) uint64 { return stalls.Load() } })
			h.Deliver(0, "a", req("a", "first"))
			for i := 1; i <= 3; i++ {
				h.Deliver(0, "a", req("a", fmt.Sprintf("queued-%d", i)))
			}
			<-entered
			stalls.Add(1)
			if c.hold {
				h.HoldShard(0)
			}
			close(gate)
			if r := rec.next(t); string(r.data) != "first" {
				t.Fatalf("first answer %+v", r)
			}
			if c.hold {
				rec.none(t) // waiting: a check of what did not happen (can pass wrongly, never fail wrongly)
			}
			c.end(h)
			if c.outcome == dropped {
				natstest.Eventually(t, 10*time.Second, "the queued messages dropped", func() bool { return h.Counts().RefusedStopping == 3 })
				rec.none(t)
			}
			for i := 1; c.outcome != dropped && i <= 3; i++ {
				r := rec.next(t)
				if want := fmt.Sprintf("queued-%d", i); c.outcome == handled && string(r.data) != want || c.outcome == refused && r.refused == "" {
					t.Fatalf("queued message %d answered %+v (%s)", i, r, c.outcome)
				}
			}
			mu.Lock()
			defer mu.Unlock()
			want := []string{"first"}
			if c.outcome == handled {
				want = append(want, "queued-1", "queued-2", "queued-3")
			}
			if !slices.Equal(got, want) {
				t.Fatalf("handled %v, want %v", got, want)
			}
		})
	}
}

// TestHostDeliverTracked: done comes once the message was handled and
// answered (an error or a panic included), never for a message that was
// refused.
func TestHostDeliverTracked(t *testing.T) {
	block, block1 := make(chan struct{}), make(chan struct{})
	f := &testFactory{handle: func(_ int, m *Message) ([]byte, error) {
		switch string(m.Data) {
		case "block":
			<-block
		case "hold":
			<-block1
		case "fail":
			return nil, errors.New("bad")
		case "panic":
			panic("boom")
		}
		return []byte("ok"), nil
	}}
	rec := newRecorder()
	h := newTestHost(t, f.factory, rec, nil)
	dones := make(chan string, 10)
	deliver := func(shard int, data string) {
		h.DeliverTracked(shard, "a", req("a", data), func() { dones <- data })
	}
	deliver(0, "block")
	select {
	case d := <-dones:
		t.Fatalf("%q done while its Handle runs", d)
	case <-time.After(20 * time.Millisecond):
	}
	close(block)
	for _, want := range []string{"block", "fail", "panic"} {
		if want != "block" {
			deliver(0, want)
		}
		rec.next(t) // answered first
		select {
		case d := <-dones:
			if d != want {
				t.Fatalf("done for %q, want %q", d, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("no done for %q", want)
		}
	}
	stopped := make(chan error, 1)
	go func() { stopped <- h.StopShard(context.Background(), 0) }()
	if err := <-stopped; err != nil {
		t.Fatal(err)
	}
	// A stopped shard's deliveries start it afresh; one being stopped
	// refuses them: hold the stop open with a blocked entity of shard 1.
	h.Deliver(1, "b", pub("b", "hold"))
	natstest.Eventually(t, 5*time.Second, "entity b busy", func() bool { return h.Active() >= 1 })
	go func() { stopped <- h.StopShard(context.Background(), 1) }()
	natstest.Eventually(t, 5*time.Second, "shard 1 closing", func() bool {
		se := h.lookup(1)
		se.mu.Lock()
		defer se.mu.Unlock()
		return se.closing
	})
	deliver(1, "late")
	if r := rec.next(t); !errors.Is(r.err, errShardNotServed) {
		t.Fatalf("late message answered %+v", r)
	}
	close(block1)
	if err := <-stopped; err != nil {
		t.Fatal(err)
	}
	select {
	case d := <-dones:
		t.Fatalf("done for the refused %q", d)
	case <-time.After(20 * time.Millisecond):
	}
}
