package kvstate

import (
	"context"
	"fmt"
	"time"

	"github.com/natshard/natshard/internal/wait"
)

// KeyStreamsLock is the key a process holds while it updates the type's
// message streams (Stream.Extend): nats-server 2.15.2 handles two updates
// of a stream's subjects at once so that both subscribe to the subjects
// they add, and the stream then stores each message published on them
// twice (docs/PROTOCOL.md, "The consumers' shape"). A lease with a TTL,
// so that a holder that died frees it.
const KeyStreamsLock = "streams-lock"

// LockStreams takes KeyStreamsLock for at most ttl, waiting while another
// process holds it (until ctx ends), and returns the function that frees
// it.
func (s *Store) LockStreams(ctx context.Context, ttl time.Duration) (unlock func(), _ error) {
	secs, err := ttlSeconds(ttl)
	if err != nil {
		return nil, err
	}
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	for backoff := 10 * time.Millisecond; ; backoff = min(2*backoff, 500*time.Millisecond) {
		rev, err := s.create(ctx, KeyStreamsLock, nil, secs)
		if err == nil {
			return func() {
				ctx, cancel := context.WithTimeout(context.Background(), s.opts.Timeout)
				defer cancel()
				_ = s.tombstone(ctx, KeyStreamsLock, rev, true, KeyStreamsLock) // else its TTL frees it
			}, nil
		}
		if !isWrongLastSeq(err) {
			return nil, translate(fmt.Errorf("take the lock of the message streams: %w", err), ErrConflict)
		}
		if !wait.Sleep(ctx, backoff) {
			return nil, fmt.Errorf("%w: the lock of the message streams stayed taken: %w", ErrUnavailable, ctx.Err())
		}
	}
}
