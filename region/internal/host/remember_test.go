package host

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
)

// memoryRemember records the Remember and Forget calls of a host.
type memoryRemember struct {
	mu     sync.Mutex
	writes []kvstate.EntityRecord
	fail   error // when set, Remember fails with it
}

func (m *memoryRemember) remember(_ context.Context, shard int, id string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.fail != nil {
		return m.fail
	}
	m.writes = append(m.writes, kvstate.EntityRecord{Shard: shard, ID: id})
	return nil
}

func (m *memoryRemember) forget(shard int, id string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.writes = append(m.writes, kvstate.EntityRecord{Shard: shard, ID: id, Forget: true})
}

func (m *memoryRemember) log() []kvstate.EntityRecord {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.writes)
}

func (m *memoryRemember) remembered(id string) bool {
	n := 0
	for _, w := range m.log() {
		if w.ID == id {
			n++
			if w.Forget {
				n = 0
			}
		}
	}
	return n > 0
}

// rememberingHost is a test host whose Remember and Forget go to store.
func rememberingHost(t *testing.T, f Factory, rec *recorder, store *memoryRemember) *Host {
	return newTestHost(t, f, rec, func(c *Config) { c.Remember, c.Forget = store.remember, store.forget })
}

// TestHostRemembers: an entity is recorded before its Factory runs, once
// per incarnation of its cell; an entity that passivates itself is
// stopped once its mailbox is empty and forgotten, and its next message
// activates and records it again; a failed record fails the activation
// (the message is answered with the error, the Factory is not called).
func TestHostRemembers(t *testing.T) {
	store := &memoryRemember{}
	var h *Host
	f := &testFactory{handle: func(_ int, m *Message) ([]byte, error) {
		if string(m.Data) == "bye" {
			h.Passivate(m.Shard, m.EntityID)
		}
		return m.Data, nil
	}}
	stopped := make(chan int, 10)
	f.stop = func(inc int) error { stopped <- inc; return nil }
	created := func(ctx context.Context, id string) (Entity, error) {
		if !store.remembered(id) {
			t.Errorf("entity %s created before it was remembered", id)
		}
		return f.factory(ctx, id)
	}
	rec := newRecorder()
	h = rememberingHost(t, created, rec, store)
	for _, d := range []string{"1", "2", "bye"} {
		h.Deliver(0, "a", req("a", d))
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
	h.Deliver(0, "a", req("a", "again"))
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
	h.Deliver(0, "b", req("b", "x"))
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
	store := &memoryRemember{}
	release := make(chan struct{})
	f := &testFactory{handle: func(_ int, m *Message) ([]byte, error) {
		if string(m.Data) == "block" {
			<-release
		}
		return m.Data, nil
	}}
	rec := newRecorder()
	h := rememberingHost(t, f.factory, rec, store)
	if !h.Start(0, "a") {
		t.Fatal("start of a new entity did nothing")
	}
	natstest.Eventually(t, 5*time.Second, "the start", func() bool { return f.calls.Load() == 1 && quiet(h) })
	if h.Start(0, "a") {
		t.Fatal("an active entity was started again")
	}
	h.Deliver(0, "a", req("a", "hi"))
	if r := rec.next(t); string(r.data) != "hi" {
		t.Fatalf("answer %q, %v", r.data, r.err)
	}
	if c := f.calls.Load(); c != 1 {
		t.Fatalf("factory called %d times", c)
	}
	if got := store.log(); len(got) != 0 {
		t.Fatalf("a started entity was recorded: %+v", got)
	}
	if err := h.StopShard(context.Background(), 0); err != nil {
		t.Fatal(err)
	}
	// Shard 1 is being stopped while its entity x handles a message.
	h.Deliver(1, "x", req("x", "block"))
	stopped := make(chan error, 1)
	go func() { stopped <- h.StopShard(context.Background(), 1) }()
	natstest.Eventually(t, 5*time.Second, "the stop to begin", func() bool {
		se := h.shardFor(1)
		se.mu.Lock()
		defer se.mu.Unlock()
		return se.closing
	})
	if h.Start(1, "b") {
		t.Fatal("an entity was started on a stopping shard")
	}
	close(release)
	if err := <-stopped; err != nil {
		t.Fatal(err)
	}
}

// TestHostPassivateWithQueuedMessages: an entity that passivates while
// messages wait in its mailbox stops after the message it handles; a new
// incarnation handles the rest.
func TestHostPassivateWithQueuedMessages(t *testing.T) {
	var h *Host
	release := make(chan struct{})
	f := &testFactory{handle: func(inc int, m *Message) ([]byte, error) {
		if string(m.Data) == "bye" {
			<-release // the next messages queue meanwhile
			h.Passivate(m.Shard, m.EntityID)
		}
		return []byte(strconv.Itoa(inc)), nil
	}}
	rec := newRecorder()
	h = newTestHost(t, f.factory, rec, nil)
	h.Deliver(0, "a", req("a", "bye"))
	h.Deliver(0, "a", req("a", "x"))
	h.Deliver(0, "a", req("a", "y"))
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
