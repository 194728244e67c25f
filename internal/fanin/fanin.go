// Package fanin keeps a publisher's order across the subscriptions of one
// receiver.
//
// NATS delivers the messages of one publisher to one connection in the
// order they were published, whatever their subjects; nats.go then hands
// each subscription's messages to that subscription's own goroutine, so two
// messages of one publisher on two subjects may reach their callbacks in
// either order. A shard of a resharded type listens on its own subject and
// on its ancestors' (docs/PROTOCOL.md, Resharding): a publisher that
// switches to the new count sends its last messages on the old subject and
// its next ones on the new, and the shard must handle them in that order.
//
// Sub counts the messages its callback finished. CaughtUp, called from
// another subscription's callback, returns once this subscription's
// callback has finished every message it had received at the call: the
// messages the connection read before the caller's. nats.go's Pending
// counts the messages queued for the callback and the one it runs (until
// the callback returned), Delivered those handed to it, so that
// Pending + Delivered, read in that order, is at least the number received
// then (a message handed over between the two reads is counted twice,
// which only makes CaughtUp wait for one more message, or for the queue to
// be empty). TestCaughtUp pins that reading of nats.go.
package fanin

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
)

// Sub is a subscription whose callback is counted (Subscribe).
type Sub struct {
	sub  *nats.Subscription
	done atomic.Uint64 // messages whose callback returned

	waiters atomic.Int32 // CaughtUp calls waiting
	mu      sync.Mutex
	changed chan struct{} // closed (and replaced) when done moved while someone waits
}

// Subscribe subscribes cb to subject on nc, with no pending limits (a
// slow callback queues, it never drops), counting what cb finished.
func Subscribe(nc *nats.Conn, subject string, cb nats.MsgHandler) (*Sub, error) {
	s := &Sub{changed: make(chan struct{})}
	sub, err := nc.Subscribe(subject, func(m *nats.Msg) {
		cb(m)
		s.done.Add(1)
		if s.waiters.Load() > 0 {
			s.mu.Lock()
			close(s.changed)
			s.changed = make(chan struct{})
			s.mu.Unlock()
		}
	})
	if err != nil {
		return nil, err
	}
	_ = sub.SetPendingLimits(-1, -1)
	s.sub = sub
	return s, nil
}

// Subscription is the nats.go subscription (to drain, unsubscribe, or
// read its pending count).
func (s *Sub) Subscription() *nats.Subscription { return s.sub }

// Unsubscribe ends the subscription; what it received and did not hand to
// its callback is discarded.
func (s *Sub) Unsubscribe() error { return s.sub.Unsubscribe() }

// poll bounds a CaughtUp wait between two checks: the callback that
// finishes the last queued message signals before nats.go lowers the
// pending count, so the check that sees the queue empty may need one more
// look.
const poll = time.Millisecond

// CaughtUp returns once the callback has finished every message the
// subscription had received when CaughtUp was called, when the
// subscription is closed, or when ctx ends (its error). It does not stop
// the subscription: what arrives meanwhile is handled as usual. It must
// not be called from s's own callback.
func (s *Sub) CaughtUp(ctx context.Context) error {
	pending, _, err := s.sub.Pending()
	if err != nil || pending == 0 {
		return nil // closed, or nothing queued nor running
	}
	delivered, err := s.sub.Delivered()
	if err != nil {
		return nil
	}
	target := uint64(pending) + uint64(delivered)
	s.waiters.Add(1)
	defer s.waiters.Add(-1)
	var t *time.Timer
	for {
		s.mu.Lock()
		changed := s.changed
		s.mu.Unlock()
		if s.done.Load() >= target {
			return nil
		}
		if p, _, err := s.sub.Pending(); err != nil || p == 0 {
			return nil
		}
		if t == nil {
			t = time.NewTimer(poll)
			defer t.Stop()
		} else {
			t.Reset(poll)
		}
		select {
		case <-changed:
		case <-t.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}
