package drain

import (
	"context"
	"errors"
	"time"

	"github.com/nats-io/nats.go"
)

// ErrCut: the subscription did not drain in time (or ctx ended) and was
// unsubscribed; messages it still held were discarded.
var ErrCut = errors.New("drain: subscription cut before it drained")

// Subscription drains sub and returns when it is closed, when timeout
// passes or when ctx ends; in the last two cases it unsubscribes and
// returns ErrCut.
func Subscription(ctx context.Context, sub *nats.Subscription, timeout time.Duration) error {
	closed := sub.StatusChanged(nats.SubscriptionClosed)
	if err := sub.Drain(); err != nil {
		if errors.Is(err, nats.ErrBadSubscription) {
			return nil // already closed
		}
		_ = sub.Unsubscribe()
		return err
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-closed:
		return nil
	case <-ctx.Done():
	case <-t.C:
	}
	_ = sub.Unsubscribe()
	return ErrCut
}
