package region

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// memoryRemember is a RememberStore in memory, with a log of its writes.
type memoryRemember struct {
	mu     sync.Mutex
	ids    map[int]map[string]bool
	writes []kvstate.EntityRecord
	fail   error // when set, RecordEntities fails with it
}

func newMemoryRemember() *memoryRemember { return &memoryRemember{ids: map[int]map[string]bool{}} }

func (m *memoryRemember) RecordEntities(_ context.Context, recs []kvstate.EntityRecord) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.fail != nil {
		return m.fail
	}
	for _, r := range recs {
		if m.ids[r.Shard] == nil {
			m.ids[r.Shard] = map[string]bool{}
		}
		if r.Forget {
			delete(m.ids[r.Shard], r.ID)
		} else {
			m.ids[r.Shard][r.ID] = true
		}
		m.writes = append(m.writes, r)
	}
	return nil
}

func (m *memoryRemember) RememberedEntities(_ context.Context, shard int) ([]string, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	var ids []string
	for id := range m.ids[shard] {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids, nil
}

func (m *memoryRemember) log() []kvstate.EntityRecord {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.writes)
}

// rememberingHost is a test host whose Remember and Forget go through an
// entityRecorder to store, as an Agent's do.
func rememberingHost(t *testing.T, f Factory, rec *recorder, store RememberStore) *host {
	a := &Agent{log: discardLogger()}
	r := newEntityRecorder(a, store)
	ctx, cancel := context.WithCancel(context.Background())
	a.wg.Add(1)
	go r.run(ctx)
	t.Cleanup(func() { cancel(); a.wg.Wait() })
	return newTestHost(t, f, rec, func(c *hostConfig) { c.Remember, c.Forget = r.remember, r.forget })
}

// TestHostRemembers: an entity is recorded before its Factory runs, once
// per incarnation of its cell; an entity that passivates itself is
// stopped once its mailbox is empty and forgotten, and its next message
// activates and records it again; a failed record fails the activation
// (the message is answered with the error, the Factory is not called).
func TestHostRemembers(t *testing.T) {
	store := newMemoryRemember()
	var h *host
	f := &testFactory{handle: func(_ int, m *Message) ([]byte, error) {
		if string(m.Data) == "bye" {
			h.passivate(m.Shard, m.EntityID)
		}
		return m.Data, nil
	}}
	stopped := make(chan int, 10)
	f.stop = func(inc int) error { stopped <- inc; return nil }
	created := func(ctx context.Context, id string) (Entity, error) {
		if got, _ := store.RememberedEntities(ctx, 0); !slices.Contains(got, id) {
			t.Errorf("entity %s created before it was remembered", id)
		}
		return f.factory(ctx, id)
	}
	rec := newRecorder()
	h = rememberingHost(t, created, rec, store)
	for _, d := range []string{"1", "2", "bye"} {
		h.deliver(0, "a", req("a", d))
		if r := rec.next(t); string(r.data) != d || r.err != nil {
			t.Fatalf("answer %q, %v", r.data, r.err)
		}
	}
	select {
	case inc := <-stopped:
		if inc != 1 {
			t.Fatalf("incarnation %d stopped", inc)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the entity that passivated itself was not stopped")
	}
	natstest.Eventually(t, 5*time.Second, "the forget", func() bool { return len(store.log()) == 2 })
	if got := store.log(); !slices.Equal(got, []kvstate.EntityRecord{{ID: "a"}, {ID: "a", Forget: true}}) {
		t.Fatalf("writes %+v", got)
	}
	h.deliver(0, "a", req("a", "again"))
	if r := rec.next(t); string(r.data) != "again" || r.err != nil {
		t.Fatalf("answer %q, %v", r.data, r.err)
	}
	if got := store.log(); len(got) != 3 || got[2] != (kvstate.EntityRecord{ID: "a"}) {
		t.Fatalf("writes after a new activation %+v", got)
	}
	if c := f.calls.Load(); c != 2 {
		t.Fatalf("factory called %d times, want 2", c)
	}

	store.mu.Lock()
	store.fail = kvstate.ErrUnavailable
	store.mu.Unlock()
	h.deliver(0, "b", req("b", "x"))
	if r := rec.next(t); !errors.Is(r.err, kvstate.ErrUnavailable) {
		t.Fatalf("activation while the store fails: %q, %v", r.data, r.err)
	}
	if c := f.calls.Load(); c != 2 {
		t.Fatalf("factory called %d times while the record failed", c)
	}
}

// TestHostStartsRemembered: start activates an entity without a message
// and without recording it again, is a no-op for an active entity and
// for a shard being stopped; the started entity handles its messages.
func TestHostStartsRemembered(t *testing.T) {
	store := newMemoryRemember()
	release := make(chan struct{})
	f := &testFactory{handle: func(_ int, m *Message) ([]byte, error) {
		if string(m.Data) == "block" {
			<-release
		}
		return m.Data, nil
	}}
	rec := newRecorder()
	h := rememberingHost(t, f.factory, rec, store)
	if !h.start(0, "a") {
		t.Fatal("start of a new entity did nothing")
	}
	natstest.Eventually(t, 5*time.Second, "the start", func() bool { return f.calls.Load() == 1 && quiet(h) })
	if h.start(0, "a") {
		t.Fatal("an active entity was started again")
	}
	h.deliver(0, "a", req("a", "hi"))
	if r := rec.next(t); string(r.data) != "hi" {
		t.Fatalf("answer %q, %v", r.data, r.err)
	}
	if c := f.calls.Load(); c != 1 {
		t.Fatalf("factory called %d times", c)
	}
	if got := store.log(); len(got) != 0 {
		t.Fatalf("a started entity was recorded: %+v", got)
	}
	if err := h.stopShard(context.Background(), 0); err != nil {
		t.Fatal(err)
	}
	// Shard 1 is being stopped while its entity x handles a message.
	h.deliver(1, "x", req("x", "block"))
	stopped := make(chan error, 1)
	go func() { stopped <- h.stopShard(context.Background(), 1) }()
	natstest.Eventually(t, 5*time.Second, "the stop to begin", func() bool {
		se := h.shardFor(1)
		se.mu.Lock()
		defer se.mu.Unlock()
		return se.closing
	})
	if h.start(1, "b") {
		t.Fatal("an entity was started on a stopping shard")
	}
	close(release)
	if err := <-stopped; err != nil {
		t.Fatal(err)
	}
}

// TestPacer: restarts go at the rate, after a burst of restartBurst's
// worth; a pause lets a new burst go, never more.
func TestPacer(t *testing.T) {
	clock := newFakeClock()
	var slept time.Duration
	p := &pacer{every: 10 * time.Millisecond, now: clock.Now, sleep: func(_ context.Context, d time.Duration) bool {
		slept += d
		clock.Advance(d)
		return true
	}}
	ctx := context.Background()
	// 11 go at once (100 ms at 10 ms each, and the one due now), then one
	// every 10 ms.
	for i := range 11 {
		p.wait(ctx)
		if slept != 0 {
			t.Fatalf("restart %d of the burst waited %v", i, slept)
		}
	}
	for range 50 {
		p.wait(ctx)
	}
	if slept != 500*time.Millisecond {
		t.Fatalf("50 restarts after the burst waited %v, want 500ms", slept)
	}
	clock.Advance(time.Hour) // idle: a burst again, of the same size
	slept = 0
	for range 20 {
		p.wait(ctx)
	}
	if slept != 90*time.Millisecond {
		t.Fatalf("20 restarts after a pause waited %v, want 90ms", slept)
	}
}

// TestHostPassivateWithQueuedMessages: an entity that passivates while
// messages wait in its mailbox stops after the message it handles; a new
// incarnation handles the rest.
func TestHostPassivateWithQueuedMessages(t *testing.T) {
	var h *host
	release := make(chan struct{})
	f := &testFactory{handle: func(inc int, m *Message) ([]byte, error) {
		if string(m.Data) == "bye" {
			<-release // the next messages queue meanwhile
			h.passivate(m.Shard, m.EntityID)
		}
		return []byte(strconv.Itoa(inc)), nil
	}}
	rec := newRecorder()
	h = newTestHost(t, f.factory, rec, nil)
	h.deliver(0, "a", req("a", "bye"))
	h.deliver(0, "a", req("a", "x"))
	h.deliver(0, "a", req("a", "y"))
	close(release)
	for i, want := range []string{"1", "2", "2"} {
		if r := rec.next(t); string(r.data) != want {
			t.Fatalf("answer %d from incarnation %s, want %s", i, r.data, want)
		}
	}
	if st := h.passivations.Load(); st != 1 {
		t.Fatalf("%d passivations", st)
	}
}

// TestRememberedAcrossSplit: after a split, a shard lists the remembered
// entities recorded under its number and under its ancestors' (from
// before the split) that are its own now, and none of another child's;
// forgetting an entity purges its key under each of those numbers.
func TestRememberedAcrossSplit(t *testing.T) {
	store := newMemoryRemember()
	a := &Agent{log: discardLogger(), cfg: Config{Shards: 8, Remember: store}}
	layout := protocol.MustLayout(4, 8)
	a.layout.Store(&layout)
	var in1, in5 []string
	for i := 0; len(in1) < 3 || len(in5) < 3; i++ {
		id := "e-" + strconv.Itoa(i)
		switch layout.ShardOf(id) {
		case 1:
			in1 = append(in1, id)
		case 5:
			in5 = append(in5, id)
		}
	}
	// Recorded before the split, under their parent 1; in5[2] after it.
	var recs []kvstate.EntityRecord
	for _, id := range append(slices.Clone(in1), in5[:2]...) {
		recs = append(recs, kvstate.EntityRecord{Shard: 1, ID: id})
	}
	recs = append(recs, kvstate.EntityRecord{Shard: 5, ID: in5[2]})
	if err := store.RecordEntities(context.Background(), recs); err != nil {
		t.Fatal(err)
	}
	for shard, want := range map[int][]string{1: in1, 5: in5} {
		got, err := a.remembered(context.Background(), shard)
		if err != nil {
			t.Fatal(err)
		}
		slices.Sort(got)
		want = slices.Sorted(slices.Values(want))
		if !slices.Equal(got, want) {
			t.Errorf("shard %d remembers %v, want %v", shard, got, want)
		}
	}
	r := newEntityRecorder(a, store)
	ctx, cancel := context.WithCancel(context.Background())
	a.wg.Add(1)
	go r.run(ctx)
	defer func() { cancel(); a.wg.Wait() }()
	r.forget(5, in5[0])
	if got, _ := a.remembered(context.Background(), 5); slices.Contains(got, in5[0]) {
		t.Fatalf("forgotten entity %s still remembered by shard 5: %v", in5[0], got)
	}
	if got, _ := store.RememberedEntities(context.Background(), 1); slices.Contains(got, in5[0]) {
		t.Fatalf("forgotten entity %s still under its parent's number", in5[0])
	}
}
