package host

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
)

// runStore is the stored state of one Flusher (runEntity): the messages
// it applied, in order, and the sequence of the last. fail decides the
// fate of the n-th write (1-based): whether it is stored, and the error
// the write returns.
type runStore struct {
	mu      sync.Mutex
	applied []string
	seq     uint64
	writes  int
	fail    func(n int) (stored bool, err error)
	events  []string // handle, skip, panic, flush, flush-failed, reply and done, in the order they happened
	handled int      // messages applied in memory since the last Flush (of any incarnation)
}

func (s *runStore) event(format string, args ...any) {
	s.mu.Lock()
	s.events = append(s.events, fmt.Sprintf(format, args...))
	s.mu.Unlock()
}

// runEntity is a persistent Flusher: Handle applies a message in memory
// (or skips it when its sequence is at or below the one applied), Flush
// writes what it applied to its runStore. panicOn makes the first
// incarnation's Handle panic on that message.
type runEntity struct {
	st      *runStore
	inc     int
	applied []string
	seq     uint64
	dirty   bool
	block   func(data string) // called first by Handle
	panicOn string
	// unavailable: Handle fails on this message with ErrUnavailable.
	unavailable string
}

func (e *runEntity) Handle(ctx context.Context, m *Message) ([]byte, error) {
	data := string(m.Data)
	if e.block != nil {
		e.block(data)
	}
	seq := SeqFrom(ctx)
	if seq != 0 && !WillFlush(ctx) {
		e.st.event("no-flush %s", data)
	}
	if seq <= e.seq {
		e.st.event("skip %s", data)
		return []byte("applied already: " + data), nil
	}
	if data == e.unavailable {
		e.st.event("unavailable %s", data)
		return nil, fmt.Errorf("load: %w", kvstate.ErrUnavailable)
	}
	if e.inc == 1 && data == e.panicOn {
		e.st.mu.Lock()
		e.st.events = append(e.st.events, "panic "+data)
		e.st.handled = 0 // what this incarnation applied is gone with it
		e.st.mu.Unlock()
		panic("boom")
	}
	e.applied = append(slices.Clip(e.applied), data)
	e.seq, e.dirty = seq, true
	e.st.mu.Lock()
	e.st.handled++
	e.st.events = append(e.st.events, "handle "+data)
	e.st.mu.Unlock()
	return m.Data, nil
}

func (e *runEntity) Flush(context.Context) error {
	if !e.dirty {
		return nil
	}
	s := e.st
	s.mu.Lock()
	defer s.mu.Unlock()
	s.writes++
	stored, err := true, error(nil)
	if s.fail != nil {
		stored, err = s.fail(s.writes)
	}
	if stored {
		s.applied, s.seq = slices.Clone(e.applied), e.seq
	}
	if err != nil {
		s.events = append(s.events, fmt.Sprintf("flush-failed %d", s.handled))
	} else {
		s.events = append(s.events, fmt.Sprintf("flush %d", s.handled))
		e.dirty = false
	}
	s.handled = 0
	return err
}

func (e *runEntity) Stop(context.Context) error { return nil }

// runHost is a host of runEntity entities on st, whose answers go to
// st's events; block is given to each entity. It returns the host and
// the factory's call count.
func runHost(t *testing.T, st *runStore, block func(string), panicOn string, unavailable ...string) (*Host, *atomic.Int32) {
	var calls atomic.Int32
	factory := func(context.Context, string) (Entity, error) {
		n := int(calls.Add(1))
		st.mu.Lock()
		defer st.mu.Unlock()
		e := &runEntity{st: st, inc: n, applied: slices.Clone(st.applied), seq: st.seq, block: block, panicOn: panicOn}
		if len(unavailable) > 0 {
			e.unavailable = unavailable[0]
		}
		return e, nil
	}
	conn := answers(func(c captured) { st.event("reply %s", c.data) })
	return newTestHost(t, factory, &recorder{}, func(c *Config) { c.Conn = conn }), &calls
}

// deliverRun delivers the messages m<from>..m<to-1> to entity "a" with
// sequence i+1, each done once into done.
func deliverRun(h *Host, st *runStore, from, to int, done chan<- string) {
	for i := from; i < to; i++ {
		data := fmt.Sprintf("m%d", i)
		h.DeliverDurable(0, "a", req("a", data), uint64(i+1), func() { st.event("done %s", data); done <- data })
	}
}

// waitDone waits for n messages done and fails on a message done twice.
func waitDone(t *testing.T, done <-chan string, n int, seen map[string]bool) {
	t.Helper()
	for range n {
		select {
		case d := <-done:
			if seen[d] {
				t.Fatalf("%s done twice", d)
			}
			seen[d] = true
		case <-time.After(30 * time.Second):
			t.Fatalf("%d of %d messages done", len(seen), n)
		}
	}
}

// checkEvents checks that each message was answered and done once, and
// only after a Flush stored it (or a Handle found it applied already):
// a "flush" stores the messages handled since the previous flush or
// failed flush. It returns the sizes of the stored runs.
func checkEvents(t *testing.T, st *runStore) []int {
	t.Helper()
	st.mu.Lock()
	defer st.mu.Unlock()
	var (
		inMemory []string
		stored   = map[string]bool{}
		replied  = map[string]int{}
		doneN    = map[string]int{}
		runs     []int
	)
	for _, ev := range st.events {
		what, arg, _ := strings.Cut(ev, " ")
		switch what {
		case "handle":
			inMemory = append(inMemory, arg)
		case "skip":
			stored[arg] = true
		case "flush":
			for _, m := range inMemory {
				stored[m] = true
			}
			runs = append(runs, len(inMemory))
			inMemory = nil
		case "flush-failed", "panic":
			inMemory = nil
		case "no-flush":
			t.Fatalf("%s of durable delivery handled with WillFlush false; events %v", arg, st.events)
		case "reply":
			m := strings.TrimPrefix(arg, "applied already: ")
			if !stored[m] {
				t.Fatalf("%s answered before it was stored; events %v", m, st.events)
			}
			replied[m]++
		case "done":
			if !stored[arg] {
				t.Fatalf("%s acknowledged before it was stored; events %v", arg, st.events)
			}
			doneN[arg]++
		}
	}
	for m, n := range doneN {
		if n != 1 || replied[m] != 1 {
			t.Fatalf("%s answered %d times, done %d times", m, replied[m], n)
		}
	}
	return runs
}

func wantApplied(t *testing.T, st *runStore, n int) {
	t.Helper()
	var want []string
	for i := range n {
		want = append(want, fmt.Sprintf("m%d", i))
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if !slices.Equal(st.applied, want) {
		t.Fatalf("stored %v, want each of m0..m%d once, in order", st.applied, n-1)
	}
}

// TestHostFlusherStoresARunInOneWrite (PROTOCOL.md, "Group commit"): the
// messages queued for a Flusher while it handled one are applied in
// memory and stored by one Flush, in runs of at most MaxRun, each
// answered and acknowledged once, after the write that stored it, every
// message applied once and in order.
func TestHostFlusherStoresARunInOneWrite(t *testing.T) {
	st := &runStore{}
	entered, release := make(chan string, 1), make(chan struct{})
	block := func(data string) {
		if data == "m0" || data == "m11" {
			entered <- data
			<-release
		}
	}
	h, calls := runHost(t, st, block, "")
	done := make(chan string, 200)
	seen := map[string]bool{}

	deliverRun(h, st, 0, 1, done)
	<-entered // m0 is being handled: m1..m10 queue behind it
	deliverRun(h, st, 1, 11, done)
	release <- struct{}{}
	waitDone(t, done, 11, seen)

	deliverRun(h, st, 11, 12, done)
	<-entered
	deliverRun(h, st, 12, 12+2*MaxRun+22, done)
	release <- struct{}{}
	n := 12 + 2*MaxRun + 22
	waitDone(t, done, n-11, seen)

	runs := checkEvents(t, st)
	if want := []int{1, 10, 1, MaxRun, MaxRun, 22}; !slices.Equal(runs, want) {
		t.Fatalf("runs stored %v, want %v", runs, want)
	}
	wantApplied(t, st, n)
	if st.writes != 6 || calls.Load() != 1 {
		t.Fatalf("%d writes, %d incarnations; want 6 writes of one incarnation for %d messages", st.writes, calls.Load(), n)
	}
}

// TestHostFlusherFailedRun: when the Flush of a run fails, none of its
// messages is answered or acknowledged; a new incarnation handles them
// again, one at a time, each stored by its own Flush, and each takes
// effect once: after a write refused (a conflict, three conflicts in a
// row, a store error), after a
// write stored whose answer was lost, and after a Handle of the run
// panicked.
func TestHostFlusherFailedRun(t *testing.T) {
	for _, tc := range []struct {
		name    string
		fail    func(n int) (bool, error)
		panicOn string
		writes  int // the writes in all
		runs    []int
	}{
		{
			name: "refused",
			fail: func(n int) (bool, error) {
				if n == 2 {
					return false, fmt.Errorf("save: %w", kvstate.ErrConflict)
				}
				return true, nil
			},
			writes: 12, runs: []int{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
		},
		{
			// A new incarnation's write refused twice more: still
			// given again, never answered with the conflict.
			name: "refused-thrice",
			fail: func(n int) (bool, error) {
				if n >= 2 && n <= 4 {
					return false, fmt.Errorf("save: %w", kvstate.ErrConflict)
				}
				return true, nil
			},
			writes: 14, runs: []int{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
		},
		{
			name: "error",
			fail: func(n int) (bool, error) {
				if n == 2 {
					return false, errors.New("disk on fire")
				}
				return true, nil
			},
			writes: 12, runs: []int{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
		},
		{
			name: "stored-answer-lost",
			fail: func(n int) (bool, error) {
				if n == 2 {
					return true, fmt.Errorf("save: %w", kvstate.ErrUnavailable)
				}
				return true, nil
			},
			writes: 2, runs: []int{1},
		},
		{
			name: "unavailable-twice",
			fail: func(n int) (bool, error) {
				if n == 2 || n == 3 {
					return false, fmt.Errorf("save: %w", kvstate.ErrUnavailable)
				}
				return true, nil
			},
			writes: 13, runs: []int{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
		},
		{
			name: "panic", panicOn: "m5",
			writes: 7, runs: []int{1, 1, 1, 1, 1, 1, 5},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := &runStore{fail: tc.fail}
			entered, release, block := blockFirstM0()
			h, calls := runHost(t, st, block, tc.panicOn)
			done := make(chan string, 20)
			seen := map[string]bool{}
			deliverRun(h, st, 0, 1, done)
			<-entered
			deliverRun(h, st, 1, 11, done)
			close(release)
			waitDone(t, done, 11, seen)
			runs := checkEvents(t, st)
			wantApplied(t, st, 11)
			if !slices.Equal(runs, tc.runs) || st.writes != tc.writes {
				t.Fatalf("runs stored %v in %d writes, want %v in %d; events %v", runs, st.writes, tc.runs, tc.writes, st.events)
			}
			if calls.Load() < 2 {
				t.Fatalf("%d incarnations: the failed run's was kept", calls.Load())
			}
		})
	}
}

// TestHostFlusherRunEnds: a run ends before a message with a key of the
// run's (answered by the first, as the first, not handled) and before a
// message that is not of durable delivery (its Handle is not followed by
// Flush).
func TestHostFlusherRunEnds(t *testing.T) {
	st := &runStore{}
	entered, release := make(chan string, 1), make(chan struct{})
	block := func(data string) {
		if data == "m0" {
			entered <- data
			<-release
		}
	}
	h, _ := runHost(t, st, block, "")
	done := make(chan string, 20)
	deliverRun(h, st, 0, 1, done)
	<-entered
	deliverRun(h, st, 1, 3, done)
	for i, data := range []string{"m3", "m4"} { // m4 has m3's key
		m := req("a", data)
		m.Header = map[string][]string{"Nats-Msg-Id": {"k1"}}
		h.DeliverDurable(0, "a", m, uint64(4+i), func() { st.event("done %s", data); done <- data })
	}
	deliverRun(h, st, 5, 7, done)
	h.Deliver(0, "a", req("a", "core")) // not durable: its sequence is 0
	close(release)
	waitDone(t, done, 7, map[string]bool{})
	natstest.Eventually(t, 10*time.Second, "the core message answered", func() bool {
		st.mu.Lock()
		defer st.mu.Unlock()
		return slices.Contains(st.events, "reply applied already: core")
	})
	st.mu.Lock()
	defer st.mu.Unlock()
	var flushes []string
	for _, ev := range st.events {
		if strings.HasPrefix(ev, "flush") {
			flushes = append(flushes, ev)
		}
	}
	// m0; m1 m2 m3, ended by m4's key; m4 answered with m3's answer, m5
	// m6, ended by the core message, which is not flushed.
	if want := []string{"flush 1", "flush 3", "flush 2"}; !slices.Equal(flushes, want) {
		t.Fatalf("flushes %v, want %v; events %v", flushes, want, st.events)
	}
	if slices.Contains(st.events, "handle m4") || slices.Contains(st.events, "reply m4") || strings.Count(fmt.Sprint(st.events), "reply m3") != 2 {
		t.Fatalf("m4 (m3's key) was handled, or not answered with m3's answer: %v", st.events)
	}
	if i, j := slices.Index(st.events, "flush 3"), slices.Index(st.events, "reply m3"); j < i {
		t.Fatalf("m3 answered before its run was stored: %v", st.events)
	}
}

// TestHostFlusherRunShardLeaves: a message of a run fails with
// ErrUnavailable until its shard leaves the region; the run before it
// is not stored without it: none of the run's messages is acknowledged,
// they stay in the stream for the next owner.
func TestHostFlusherRunShardLeaves(t *testing.T) {
	st := &runStore{}
	entered, release, block := blockFirstM0()
	h, _ := runHost(t, st, block, "", "m3")
	done := make(chan string, 20)
	deliverRun(h, st, 0, 1, done)
	<-entered
	deliverRun(h, st, 1, 5, done)
	close(release)
	waitDone(t, done, 1, map[string]bool{})
	natstest.Eventually(t, 10*time.Second, "m3 given again", func() bool {
		st.mu.Lock()
		defer st.mu.Unlock()
		return strings.Count(fmt.Sprint(st.events), "unavailable m3") >= 2
	})
	h.AbortShard(0)
	if err := h.StopShard(context.Background(), 0); err != nil {
		t.Fatal(err)
	}
	select {
	case d := <-done:
		t.Fatalf("%s acknowledged; events %v", d, st.events)
	default:
	}
	wantApplied(t, st, 1)
}

// blockFirstM0 returns a Handle hook that holds the first handling of
// "m0" until release is closed, saying so on entered; m0 handled again
// does not block.
func blockFirstM0() (entered chan string, release chan struct{}, block func(data string)) {
	entered, release = make(chan string, 1), make(chan struct{})
	block = func(data string) {
		if data == "m0" {
			select {
			case entered <- data:
				<-release
			default: // handled again
			}
		}
	}
	return entered, release, block
}
