package coordinator

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// TestParkerTerms: parkings belong to the term that parked or adopted
// them. A term's unpark ends only its own; the next term adopts a shard by
// parking it again and releases the parkings it did not adopt; stop ends
// them all. Each parked shard's buffer is read to see whether its
// subscription still diverts.
func TestParkerTerms(t *testing.T) {
	nc := natstest.Connect(t, natstest.URL(natstest.RunServer(t)))
	subjects := protocol.MustSubjects("", "", "kv")
	buffer, err := kvstate.OpenBuffer(context.Background(), natstest.JetStream(t, nc), subjects, kvstate.BufferOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p := newParker(nc, buffer, subjects, slog.New(slog.NewTextHandler(io.Discard, nil)), nil)
	for shard := range 4 {
		if err := p.park(shard, uint64(10+shard), 1); err != nil {
			t.Fatal(err)
		}
	}
	sent := 0
	// want checks that of shards 0-3 those of shards divert: a message
	// published to each of them reaches its buffer, and a request to each
	// other finds no subscriber (the server says "no responders" at once).
	lens := make([]uint64, 4)
	want := func(what string, shards ...int) {
		t.Helper()
		sent++
		for shard := range 4 {
			subject := subjects.Entity(shard, fmt.Sprintf("e%d", sent))
			if !slices.Contains(shards, shard) {
				if _, err := nc.Request(subject, nil, 10*time.Second); !errors.Is(err, nats.ErrNoResponders) {
					t.Fatalf("%s: shard %d diverts (a request to it: %v); want only %v", what, shard, err, shards)
				}
				continue
			}
			if err := nc.Publish(subject, nil); err != nil {
				t.Fatal(err)
			}
			natstest.Eventually(t, 10*time.Second, fmt.Sprintf("%s: the message to shard %d in its buffer", what, shard), func() error {
				if err := buffer.Flush(context.Background()); err != nil {
					return err
				}
				n, err := buffer.Len(context.Background(), shard)
				if err == nil && n <= lens[shard] {
					err = fmt.Errorf("%d messages in it, as before", n)
				}
				if err == nil {
					lens[shard] = n
				}
				return err
			})
		}
	}
	want("parked by term 1", 0, 1, 2, 3)

	// Term 2 adopts shards 0 and 1 (1 under a new handoff id), and the
	// draining shard 3 (its parking resumes once the drain is done).
	for shard, handoff := range map[int]uint64{0: 10, 1: 21} {
		if err := p.park(shard, handoff, 2); err != nil {
			t.Fatal(err)
		}
	}
	p.mu.Lock()
	draining := p.parked[3]
	draining.drained = make(chan struct{})
	p.mu.Unlock()
	if err := p.park(3, 23, 2); err != nil {
		t.Fatal(err)
	}
	p.unsubscribe(0, 10, 1) // term 1's late unpark: not its parking any more
	p.unsubscribe(1, 11, 2) // an older handoff's
	if got := p.releaseOthers(2); !slices.Equal(got, []int{2}) {
		t.Fatalf("term 2 released %v, want [2]", got)
	}
	p.end(3, draining)
	natstest.Eventually(t, 10*time.Second, "shard 2 released", func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.parked[2] == nil
	})
	p.mu.Lock()
	for shard, want := range map[int]uint64{0: 2, 1: 2, 3: 2} {
		if pk := p.parked[shard]; pk == nil || pk.term != want || pk.draining() {
			t.Errorf("shard %d: parking %+v, want term %d's", shard, pk, want)
		}
	}
	p.mu.Unlock()
	want("term 2", 0, 1, 3)

	p.unsubscribe(1, 21, 2)
	want("shard 1 unparked by term 2", 0, 3)

	// Term 2 unparks shard 3 while an earlier parking of it drains, its
	// own waiting for the drain: that park is cancelled, and unsubscribe
	// returns once the drain is done (the end marker comes after it).
	p.mu.Lock()
	draining = p.parked[3]
	draining.drained = make(chan struct{})
	p.mu.Unlock()
	if err := p.park(3, 33, 2); err != nil {
		t.Fatal(err)
	}
	unparked := make(chan struct{})
	go func() {
		p.unsubscribe(3, 33, 2)
		close(unparked)
	}()
	// The park is cancelled: unsubscribe now waits for the drain.
	natstest.Eventually(t, 10*time.Second, "the park of shard 3 cancelled", func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return draining.again == nil
	})
	select {
	case <-unparked:
		t.Fatal("unsubscribe returned before the drain of the earlier parking")
	default:
	}
	p.end(3, draining)
	<-unparked
	want("shard 3 unparked by term 2 after its drain", 0)
	if got := p.stop(); !slices.Equal(got, []int{0}) {
		t.Fatalf("stop released %v, want [0]", got)
	}
	want("stopped")
}

// TestParkerSplitChild: a child of a resharded type is parked on its own
// subject and its parent's, keeps only its own entities' messages, and a
// publisher that switched to the new count finds its messages in the
// buffer in the order it sent them (docs/PROTOCOL.md, Resharding; the
// order under a slow subscription is internal/fanin's test).
func TestParkerSplitChild(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	nc, pub := natstest.Connect(t, url), natstest.Connect(t, url)
	subjects := protocol.MustSubjects("", "", "kv")
	buffer, err := kvstate.OpenBuffer(context.Background(), natstest.JetStream(t, nc), subjects, kvstate.BufferOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p := newParker(nc, buffer, subjects, slog.New(slog.NewTextHandler(io.Discard, nil)), nil)
	layout := protocol.MustLayout(4, 8)
	p.setLayout(layout)
	const child = 5 // of parent 1
	if err := p.park(child, 7, 1); err != nil {
		t.Fatal(err)
	}
	var mine, sibling []string
	for i := 0; len(mine) < 200 || len(sibling) < 50; i++ {
		id := fmt.Sprintf("e-%d", i)
		switch layout.ShardOf(id) {
		case child:
			mine = append(mine, id)
		case 1:
			sibling = append(sibling, id)
		}
	}
	mine = mine[:200]
	// The first half on the parent's subject (the old count), with the
	// sibling's messages among them, the rest on the child's.
	var want []string
	for i, id := range mine {
		subject := subjects.Entity(1, id)
		if i >= len(mine)/2 {
			subject = subjects.Entity(child, id)
		} else if i < len(sibling) {
			if err := pub.Publish(subjects.Entity(1, sibling[i]), []byte("sibling")); err != nil {
				t.Fatal(err)
			}
		}
		if err := pub.Publish(subject, []byte(id)); err != nil {
			t.Fatal(err)
		}
		want = append(want, id)
	}
	if err := pub.Flush(); err != nil {
		t.Fatal(err)
	}
	p.unsubscribe(child, 7, 1) // drains every subject: what they received is appended
	if err := buffer.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := buffer.Mark(context.Background(), child, 7); err != nil {
		t.Fatal(err)
	}
	var got []string
	if _, err := buffer.Replay(context.Background(), child, 7, func(_ uint64, m *nats.Msg) { got = append(got, string(m.Data)) }); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("buffer of shard %d holds %d messages %v..., want the %d of its entities in the order sent", child, len(got), got[:min(len(got), 5)], len(want))
	}
}
