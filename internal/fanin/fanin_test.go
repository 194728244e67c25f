package fanin

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/natstest"
)

// TestCaughtUp: CaughtUp returns only once the callback has finished every
// message received before the call, and at once when nothing is queued.
// It pins the reading of nats.go's Pending and Delivered the package rests
// on: a nats.go that counted otherwise fails here.
func TestCaughtUp(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	recv, pub := natstest.Connect(t, url), natstest.Connect(t, url)
	gate := make(chan struct{})
	var mu sync.Mutex
	var handled []string
	s, err := Subscribe(recv, "old", func(m *nats.Msg) {
		<-gate
		mu.Lock()
		handled = append(handled, string(m.Data))
		mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := recv.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := s.CaughtUp(t.Context()); err != nil {
		t.Fatalf("CaughtUp with nothing received: %v", err)
	}
	for i := range 10 {
		if err := pub.Publish("old", []byte(strconv.Itoa(i))); err != nil {
			t.Fatal(err)
		}
	}
	if err := pub.Flush(); err != nil {
		t.Fatal(err)
	}
	natstest.Eventually(t, time.Minute, "the ten messages to be received", func() bool {
		p, _, _ := s.Subscription().Pending()
		return p == 10
	})
	returned := make(chan int, 1)
	go func() {
		_ = s.CaughtUp(context.Background())
		mu.Lock()
		returned <- len(handled)
		mu.Unlock()
	}()
	select {
	case n := <-returned:
		t.Fatalf("CaughtUp returned with %d of 10 messages handled", n)
	default:
	}
	close(gate)
	if n := <-returned; n != 10 {
		t.Fatalf("CaughtUp returned with %d of 10 messages handled", n)
	}
	// Closed: at once.
	_ = s.Unsubscribe()
	if err := s.CaughtUp(t.Context()); err != nil {
		t.Fatal(err)
	}
}

// TestOrderAcrossSubjects: a publisher sends its first messages on one
// subject and the rest on another (a publisher switching to a type's new
// shard count); the receiver's first subscription is slow. The newer
// subscription's callback waits for the older one to catch up, and the
// receiver sees the publisher's order.
func TestOrderAcrossSubjects(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	recv, pub := natstest.Connect(t, url), natstest.Connect(t, url)
	const n = 2000
	var mu sync.Mutex
	var got []int
	record := func(m *nats.Msg) {
		i, _ := strconv.Atoi(string(m.Data))
		mu.Lock()
		got = append(got, i)
		mu.Unlock()
	}
	old, err := Subscribe(recv, "old", func(m *nats.Msg) {
		time.Sleep(20 * time.Microsecond) // a backlog builds up
		record(m)
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Subscribe(recv, "new", func(m *nats.Msg) {
		if err := old.CaughtUp(context.Background()); err != nil {
			t.Error(err)
		}
		record(m)
	}); err != nil {
		t.Fatal(err)
	}
	if err := recv.Flush(); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		subject := "old"
		if i >= n/2 {
			subject = "new"
		}
		if err := pub.Publish(subject, []byte(strconv.Itoa(i))); err != nil {
			t.Fatal(err)
		}
	}
	if err := pub.Flush(); err != nil {
		t.Fatal(err)
	}
	natstest.Eventually(t, time.Minute, "every message", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(got) == n
	})
	for i, v := range got {
		if v != i {
			t.Fatalf("message %d handled in place %d: %v...", v, i, got[max(0, i-3):min(len(got), i+3)])
		}
	}
}
