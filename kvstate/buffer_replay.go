package kvstate

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/protocol"
)

// Replay reads shard's buffer in order from its first message and calls fn
// with each buffered message's stream sequence and the message as it was
// published (Subject, Reply, Header and Data restored; the buffer's own
// headers removed), skipping end markers of other handoffs, until the end
// marker of handoff; it waits for more messages until then. It returns the
// marker's sequence, or ctx's error. fn runs on Replay's goroutine, one
// message at a time.
//
// Replay reads through an ephemeral pull consumer (memory, R1, no acks)
// with one Fetch after another, each bounded by replayWait, and deletes
// the consumer when it returns; the server deletes it after a minute of
// inactivity if Replay's process dies. It does not use the client's
// ordered consumer, whose iterator sends one long pull request and waits
// 10 s of missed heartbeats before it notices that the request was lost:
// on a cluster the first pull request to a consumer just created is
// sometimes lost (the load test saw replays stall for 10 s). A lost Fetch
// costs at most replayWait here. A gap in the consumer's delivery
// sequence (a message lost in transit), or a consumer that stops answering
// (deleted, or lost with its server), makes Replay resume on a new
// consumer from the stream sequence after the last message it read.
//
// A message that the source of a fenced handoff appended after the fence
// (see Fence) is skipped. A message without protocol.HeaderSubject was not
// appended by Append: it is skipped silently. A restored message has a nil Header when the
// original had none; Data may be an empty slice instead of nil. Replay
// does not remove anything: see Purge.
func (b *Buffer) Replay(ctx context.Context, shard int, handoff uint64, fn func(seq uint64, m *nats.Msg)) (uint64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	r := &replay{b: b, subject: b.subjects.BufferShard(shard), want: strconv.FormatUint(handoff, 10), fn: fn}
	if b.opts.Logger != nil {
		log := b.opts.Logger.With("shard", shard, "handoff", handoff)
		stop := r.watch(ctx, log)
		defer stop()
		defer func() {
			if n := r.fencedOut.Load(); n > 0 {
				log.Warn("replay skipped messages a fenced source appended after its fence", "skipped", n, "fenced", slices.Sorted(maps.Keys(r.fenced)))
			}
		}()
	}
	defer r.setConsumer(nil)
	if err := r.start(ctx); err != nil {
		return 0, err
	}
	for {
		seq, done, err := r.run(ctx)
		if done || err != nil {
			return seq, err
		}
		// A gap: resume on a new consumer after the last message read.
	}
}

// start sets where the replay begins: the first message of the shard's
// buffer as the stream's leader has it, or past its last message when the
// buffer is empty. The consumer cannot start from "all": on a replicated
// stream it may be placed on a follower that has not yet applied the
// previous owner's Purge, and would deliver purged messages again.
func (r *replay) start(ctx context.Context) error {
	ctx, cancel := r.b.ctx(ctx)
	defer cancel()
	// Last first: a message appended after Info is found by GetMsg.
	info, err := r.b.stream.Info(ctx)
	if err != nil {
		return translate(fmt.Errorf("replay %s: %w", r.subject, err), ErrConflict)
	}
	first, err := r.b.stream.GetMsg(ctx, 1, jetstream.WithGetMsgSubject(r.subject))
	switch {
	case err == nil:
		r.next = first.Sequence
	case errors.Is(err, jetstream.ErrMsgNotFound):
		r.next = info.State.LastSeq + 1
	default:
		return translate(fmt.Errorf("replay %s: %w", r.subject, err), ErrConflict)
	}
	return nil
}

// replay is the state of one Replay.
type replay struct {
	b       *Buffer
	subject string // messages and markers of the shard, in stream order
	want    string // the handoff id of the marker that ends the replay
	fn      func(seq uint64, m *nats.Msg)

	next     uint64 // stream sequence to start or resume from
	read     atomic.Uint64
	fetches  atomic.Uint64
	replaced atomic.Uint64 // consumers replaced after replayIdle empty fetches

	// fenced: the handoff ids of the fences read so far; fencedOut counts
	// the messages skipped for them (see Fence).
	fenced    map[string]bool
	fencedOut atomic.Uint64

	mu   sync.Mutex
	cons jetstream.Consumer // the current one, for the watch and deletion
}

// replayWait bounds each Fetch of a Replay: how long a lost pull request
// (or an empty buffer) holds it up before the next one.
const replayWait = time.Second

// replayFailures: see replay.run.
const replayFailures = 5

// replayIdle is how many fetches in a row may bring nothing before the
// consumer is replaced, from where the replay was (r.next: nothing is
// skipped or replayed twice). The consumer acknowledges nothing
// (AckNone): what it delivered into a connection that then died (a
// partition, a route black-holed) it never delivers again, and a gap is
// seen only when a later message comes. When the lost message was the
// last one, the end marker, the replay waited for ever, its consumer
// saying nothing was pending (the fault campaign, core seeds 9 and 13;
// TestReplayTailLost; docs/FAULTS.md).
const replayIdle = 10

// run reads from a new consumer until the marker (done), ctx's end or a
// failure to create the consumer (err), or a gap in the delivery sequence
// or a lost consumer (neither: run again).
func (r *replay) run(ctx context.Context) (seq uint64, done bool, err error) {
	cfg := jetstream.ConsumerConfig{
		FilterSubject:     r.subject,
		DeliverPolicy:     jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:       r.next,
		AckPolicy:         jetstream.AckNonePolicy,
		MemoryStorage:     true,
		Replicas:          1,
		InactiveThreshold: replayInactive,
	}
	cctx, cancel := r.b.ctx(ctx)
	cons, err := r.b.js.CreateConsumer(cctx, r.b.name, cfg)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return 0, false, ctx.Err()
		}
		return 0, false, translate(fmt.Errorf("replay %s: %w", r.subject, err), ErrConflict)
	}
	r.setConsumer(cons)
	var delivered uint64 // the consumer's delivery sequence so far
	failures, idle := 0, 0
	for {
		r.fetches.Add(1)
		batch, err := cons.Fetch(replayBatch, jetstream.FetchMaxWait(replayWait))
		if err != nil {
			return 0, false, translate(fmt.Errorf("replay %s: %w", r.subject, err), ErrConflict)
		}
		got := 0
		for msgs := batch.Messages(); ; {
			var jm jetstream.Msg
			var ok bool
			select {
			case jm, ok = <-msgs:
			case <-ctx.Done():
				return 0, false, ctx.Err()
			}
			if !ok {
				break
			}
			md, err := jm.Metadata()
			if err != nil {
				return 0, false, fmt.Errorf("replay %s: %w", r.subject, err)
			}
			if md.Sequence.Consumer != delivered+1 {
				return 0, false, nil // a gap: resume from r.next
			}
			delivered = md.Sequence.Consumer
			got++
			r.next = md.Sequence.Stream + 1
			r.read.Add(1)
			h := jm.Headers()
			if v, ok := h[protocol.HeaderMarker]; ok {
				if len(v) > 0 && v[0] == r.want {
					return md.Sequence.Stream, true, nil
				}
				continue // the marker of another handoff
			}
			if v, ok := h[protocol.HeaderFence]; ok {
				if len(v) > 0 {
					if r.fenced == nil {
						r.fenced = map[string]bool{}
					}
					r.fenced[v[0]] = true
				}
				continue
			}
			if v, ok := h[protocol.HeaderSource]; ok && len(v) > 0 && r.fenced[v[0]] {
				r.fencedOut.Add(1) // a zombie source's append, stored after its fence
				continue
			}
			if m := restore(h, jm.Data()); m != nil {
				r.fn(md.Sequence.Stream, m)
			}
		}
		// The batch ended: full, expired, or failed. Fetch again. A pull
		// request may fail with "no responders" while the new consumer's
		// subscription is not yet known to every server; it also fails so
		// when the consumer is gone (deleted, or lost with its server), so
		// after replayFailures failures in a row the consumer is replaced.
		switch err := batch.Error(); {
		case err == nil && got == 0 && idle+1 >= replayIdle:
			r.replaced.Add(1)
			return 0, false, nil
		case err == nil:
			failures = 0
			idle = min(idle+1, replayIdle)
			if got > 0 {
				idle = 0
			}
		case errors.Is(err, jetstream.ErrConsumerDeleted), failures+1 >= replayFailures:
			return 0, false, nil
		default:
			failures++
			if !wait.Sleep(ctx, 50*time.Millisecond) {
				return 0, false, ctx.Err()
			}
		}
		if ctx.Err() != nil {
			return 0, false, ctx.Err()
		}
	}
}

// setConsumer makes cons the current consumer and deletes the previous
// one, in the background (it would expire anyway, see replayInactive).
func (r *replay) setConsumer(cons jetstream.Consumer) {
	r.mu.Lock()
	old := r.cons
	r.cons = cons
	r.mu.Unlock()
	if old == nil {
		return
	}
	name := old.CachedInfo().Name
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), r.b.opts.Timeout)
		defer cancel()
		_ = r.b.js.DeleteConsumer(ctx, r.b.name, name)
	}()
}

// watch logs a warning every replayWatch until stop is called, with what
// the replay and its consumer say: a replay that waits long for its marker
// is worth an operator's look (is the source alive? is the stream?).
func (r *replay) watch(ctx context.Context, log *slog.Logger) (stop func()) {
	began := time.Now()
	var (
		mu    sync.Mutex
		ended bool
		t     *time.Timer
	)
	mu.Lock()
	defer mu.Unlock()
	t = time.AfterFunc(replayWatch, func() {
		args := []any{"waiting", time.Since(began).Round(time.Millisecond).String(), "read", r.read.Load(), "fetches", r.fetches.Load(), "consumers_replaced", r.replaced.Load()}
		r.mu.Lock()
		cons := r.cons
		r.mu.Unlock()
		if cons != nil {
			ictx, cancel := context.WithTimeout(ctx, r.b.opts.Timeout)
			info, err := cons.Info(ictx)
			cancel()
			if err != nil {
				args = append(args, "consumer_info_err", err)
			} else {
				args = append(args, "consumer", info.Name, "pending", info.NumPending, "delivered_stream_seq", info.Delivered.Stream, "waiting_pulls", info.NumWaiting)
				if info.Cluster != nil {
					args = append(args, "consumer_server", info.Cluster.Leader)
				}
			}
		}
		mu.Lock()
		defer mu.Unlock()
		if !ended {
			log.Warn("replay still waiting for its end marker", args...)
			t.Reset(replayWatch)
		}
	})
	return func() {
		mu.Lock()
		ended = true
		t.Stop()
		mu.Unlock()
	}
}

// restore rebuilds the message Append buffered from the buffered headers
// and data; nil if they lack protocol.HeaderSubject.
func restore(h nats.Header, data []byte) *nats.Msg {
	subj := h.Get(protocol.HeaderSubject)
	if subj == "" {
		return nil
	}
	m := &nats.Msg{Subject: subj, Reply: h.Get(protocol.HeaderReply), Data: data}
	for k, v := range h {
		if k == protocol.HeaderSubject || k == protocol.HeaderReply || k == protocol.HeaderSource {
			continue
		}
		if m.Header == nil {
			m.Header = make(nats.Header, len(h))
		}
		m.Header[strings.TrimPrefix(k, escapePrefix)] = v
	}
	return m
}
