package region

import (
	"context"
	"fmt"
	"github.com/natshard/natshard/internal/wait"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

// Backoff between attempts of a replay or a purge that failed.
const (
	retryFirst = 100 * time.Millisecond
	retryMax   = 2 * time.Second
)

// replay is the goroutine of a binding shard (modeHold): it replays the
// shard's buffer up to the end marker handoff, delivering each message to
// its entity at once (the source may still be appending meanwhile), then
// purges the buffer up to the marker, delivers the held arrivals that were
// not replayed and goes live. It ends early when ctx ends (the shard was
// dropped, or the region fenced or closed). prior, when not nil, is closed
// when the entities of the shard's previous life in this region have
// stopped; nothing is delivered before.
func (a *Agent) replay(ctx context.Context, st *shardState, handoff uint64, prior <-chan struct{}) {
	if prior != nil {
		select {
		case <-prior:
		case <-ctx.Done():
			return
		}
	}
	// A failed attempt is retried from the start of the buffer, which
	// nobody purges while this replay runs: the messages the earlier
	// attempts delivered are skipped.
	done := 0
	backoff := retryFirst
	var marker uint64
	for {
		skip := done
		seq, err := a.cfg.Buffer.Replay(ctx, st.n, handoff, func(m *nats.Msg) {
			if skip > 0 {
				skip--
				return
			}
			done++
			a.deliverReplayed(st, m)
		})
		if err == nil {
			marker = seq
			break
		}
		if ctx.Err() != nil {
			return
		}
		a.limit.log(a.log, "replay-failed", "replaying a shard's buffer failed; retrying", "shard", st.n, "handoff", handoff, "err", err)
		if !wait.Sleep(ctx, backoff) {
			return
		}
		backoff = min(backoff*2, retryMax)
	}
	// Purge before going live: the shard's next move may start as soon as
	// it is live, and its new owner replays the buffer from the start, so
	// messages left in it would be handled twice (a load test caught that
	// when the purge came after). Held arrivals wait meanwhile.
	for backoff = retryFirst; ; backoff = min(backoff*2, retryMax) {
		err := a.cfg.Buffer.Purge(ctx, st.n, marker)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return
		}
		a.limit.log(a.log, "purge-failed", "purging a shard's buffer failed; retrying", "shard", st.n, "upto", marker, "err", err)
		if !wait.Sleep(ctx, backoff) {
			return
		}
	}
	a.goLive(st, done)
}

// deliverReplayed hands a replayed message to its entity and remembers its
// Nats-Msg-Id, so that the held copy of it is skipped.
func (a *Agent) deliverReplayed(st *shardState, m *nats.Msg) {
	shard, id, err := a.cfg.Subjects.ParseEntity(m.Subject, a.cfg.Shards)
	if err == nil && shard != st.n {
		err = fmt.Errorf("%w: buffered message %q of shard %d in the buffer of shard %d", protocol.ErrWrongShard, m.Subject, shard, st.n)
	}
	if err != nil {
		a.malformed(m, err)
		return
	}
	st.mu.Lock()
	if st.mode != modeHold {
		st.mu.Unlock()
		return // dropped: the replay is being cancelled
	}
	mid := m.Header.Get(protocol.HeaderMsgID)
	if mid != "" {
		st.seen[mid] = struct{}{}
	}
	a.log.Debug("replayed", "shard", st.n, "handoff", st.handoff, "msg_id", mid)
	a.host.deliver(st.n, id, m)
	st.mu.Unlock()
	a.stats.Replayed.Add(1)
	a.stats.Delivered.Add(1)
}

// goLive ends the replay of st: under the shard's lock it delivers the
// held messages in arrival order, skipping those whose Nats-Msg-Id was
// replayed, and switches the shard to live. It reports false when the
// shard was dropped meanwhile.
func (a *Agent) goLive(st *shardState, replayed int) bool {
	st.mu.Lock()
	if st.mode != modeHold {
		st.mu.Unlock()
		return false
	}
	held, skipped := len(st.held), 0
	for _, h := range st.held {
		mid := h.m.Header.Get(protocol.HeaderMsgID)
		if mid != "" {
			if _, dup := st.seen[mid]; dup {
				skipped++
				continue
			}
		}
		a.log.Debug("held message delivered", "shard", st.n, "handoff", st.handoff, "msg_id", mid)
		a.host.deliver(st.n, h.id, h.m)
	}
	// A copy of a replayed message may still come: the subscription may
	// not have delivered everything it received before this point (its
	// callback is busy), or a copy may be on its way. Such copies were
	// published before the source released the shard, so they come soon
	// after: the replayed ids are kept until the subscription delivered
	// what it had queued now and a release grace passed (the load test on
	// a cluster saw copies arrive 30 ms after going live).
	queued, _, _ := st.sub.Pending()
	st.dedupUntil = st.arrivals + uint64(max(queued, 0))
	st.dedupEnd = time.Now().Add(a.cfg.ReleaseGrace)
	if len(st.seen) == 0 {
		st.seen = nil
	}
	st.held = nil
	st.mode = modeLive
	handoff := st.handoff
	st.mu.Unlock()
	a.stats.DuplicatesSkipped.Add(uint64(skipped))
	a.stats.Delivered.Add(uint64(held - skipped))
	a.log.Info("shard live", "shard", st.n, "handoff", handoff, "replayed", replayed, "held", held, "duplicates_skipped", skipped)
	return true
}
