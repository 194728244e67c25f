package region

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/kvstate"
)

// Remembered entities (Config.Remember), Akka's remember-entities: the
// region records the id of each entity it activates before the entity's
// Factory runs, forgets it when the entity passivates itself
// (Agent.Passivate), and, once a shard goes live here, starts again
// every entity the shard remembers, at a bounded rate for the whole
// region (Config.RestartRate), so that a move, a crash or a full restart
// brings the entities back without a message, and without a storm of
// activations.
//
// The records are batched: one batch in flight per region, the changes
// queued meanwhile written next, pipelined. So an activation waits for
// one store round trip (and the batch before it), and the writes never
// outnumber the activations and passivations.

// RememberStore keeps the remembered entities (kvstate.Store does).
type RememberStore interface {
	// RecordEntities stores the changes, in order.
	RecordEntities(ctx context.Context, recs []kvstate.EntityRecord) error
	// RememberedEntities lists the entities shard remembers, every
	// change recorded before the call included.
	RememberedEntities(ctx context.Context, shard int) ([]string, error)
}

// DefaultRestartRate is Config.RestartRate's default: remembered entities
// started per second by one region.
const DefaultRestartRate = 1000

const (
	// recordBatch bounds the changes written in one batch.
	recordBatch = 1024
	// recordTimeout bounds a batch's writes.
	recordTimeout = 10 * time.Second
	// restartBurst: the restarts of this long at the rate may come at
	// once.
	restartBurst = 100 * time.Millisecond
)

// entityRecorder batches the changes of the remembered entities. Its run
// goroutine owns the batch: the entities send it their changes through
// queue.
type entityRecorder struct {
	store RememberStore
	a     *Agent
	ctx   context.Context // of run
	stop  context.CancelFunc
	queue chan recordReq
}

type recordReq struct {
	rec  kvstate.EntityRecord
	done chan error
}

func newEntityRecorder(a *Agent, store RememberStore) *entityRecorder {
	r := &entityRecorder{store: store, a: a, queue: make(chan recordReq, recordBatch)}
	// Its own context, ended by Agent.Close once the entities have
	// stopped: the forgets of entities stopping in Close are written.
	r.ctx, r.stop = context.WithCancel(context.Background())
	return r
}

// remember records entity id of shard and returns once it is stored.
func (r *entityRecorder) remember(ctx context.Context, shard int, id string) error {
	done := make(chan error, 1)
	if !r.push(recordReq{rec: kvstate.EntityRecord{Shard: shard, ID: id}, done: done}) {
		return ErrClosed
	}
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	case <-r.ctx.Done():
		return ErrClosed
	}
}

// forget removes entity id of shard from the record and returns once that
// is stored (or failed: the entity then stays remembered, and is started
// again by its shard's next owner). It runs on the entity's goroutine,
// which its shard's stop waits for: so a shard's next owner, which reads
// the record when it takes the shard, does not start an entity that
// passivated itself just before the move (or the process's Close).
func (r *entityRecorder) forget(shard int, id string) {
	// An entity of a split child may still be recorded under an
	// ancestor's number (from before the split): it is forgotten there
	// too, or the child would start it again.
	tokens := r.a.layoutNow().Tokens(shard)
	for _, t := range tokens[:len(tokens)-1] {
		r.push(recordReq{rec: kvstate.EntityRecord{Shard: t, ID: id, Forget: true}, done: make(chan error, 1)})
	}
	done := make(chan error, 1)
	if !r.push(recordReq{rec: kvstate.EntityRecord{Shard: shard, ID: id, Forget: true}, done: done}) {
		return
	}
	select {
	case <-done:
	case <-r.ctx.Done():
	}
}

// push hands req to run; false: the recorder stopped.
func (r *entityRecorder) push(req recordReq) bool {
	select {
	case r.queue <- req:
		return true
	case <-r.ctx.Done():
		return false
	}
}

// run writes the queued changes, a batch at a time, until ctx ends; then
// it fails what waits.
func (r *entityRecorder) run(ctx context.Context) {
	defer r.a.wg.Done()
	batch := make([]recordReq, 0, recordBatch)
	for {
		select {
		case <-ctx.Done():
			for {
				select {
				case req := <-r.queue:
					req.done <- ErrClosed
				default:
					return
				}
			}
		case req := <-r.queue:
			batch = append(batch[:0], req)
		}
		// What was queued meanwhile goes in the same batch.
	more:
		for len(batch) < recordBatch {
			select {
			case req := <-r.queue:
				batch = append(batch, req)
			default:
				break more
			}
		}
		recs := make([]kvstate.EntityRecord, len(batch))
		for i, req := range batch {
			recs[i] = req.rec
		}
		wctx, cancel := context.WithTimeout(ctx, recordTimeout)
		err := r.store.RecordEntities(wctx, recs)
		cancel()
		forgets := 0
		for _, req := range batch {
			req.done <- err
			if req.rec.Forget {
				forgets++
			}
		}
		if err != nil && forgets > 0 {
			// The entities stay remembered: they are started again
			// after their shard's next move, and may passivate again.
			r.a.limit.log(r.a.log, "forget-failed", "cannot forget passivated entities; they stay remembered", "entities", forgets, "err", err)
		}
	}
}

// pacer spaces the restarts of remembered entities: every per entity,
// with bursts of at most restartBurst. The restarts of several shards
// share it without a lock: each takes its slot by a compare-and-swap.
type pacer struct {
	every time.Duration
	// now and sleep are the clock (nil: time.Now and wait.Sleep).
	now   func() time.Time
	sleep func(ctx context.Context, d time.Duration) bool

	next atomic.Pointer[time.Time] // the next slot (nil: none taken yet)
}

// wait returns when the next restart may go, false when ctx ended first.
func (p *pacer) wait(ctx context.Context) bool {
	now, sleep := time.Now, wait.Sleep
	if p.now != nil {
		now, sleep = p.now, p.sleep
	}
	var t, at time.Time
	for {
		t = now()
		next := p.next.Load()
		at = t.Add(-restartBurst)
		if next != nil && next.After(at) {
			at = *next
		}
		after := at.Add(p.every)
		if p.next.CompareAndSwap(next, &after) {
			break
		}
	}
	if d := at.Sub(t); d > 0 {
		return sleep(ctx, d)
	}
	return ctx.Err() == nil
}

// restartRemembered starts the remembered entities of shard n, live here
// through st, at the region's rate, until they are all started or the
// shard is no longer live here. Each start is made under st's lock, which
// a pause takes before the driver stops the shard's entities: a start is
// either stopped with them or not made.
func (a *Agent) restartRemembered(st intake, n int) {
	defer a.host.RestartsDone(n)
	began := time.Now()
	var ids []string
	for backoff := wait.RetryFirst; ; backoff = wait.Next(backoff) {
		ctx, cancel := context.WithTimeout(a.ctx, recordTimeout)
		var err error
		ids, err = a.remembered(ctx, n)
		cancel()
		if err == nil {
			break
		}
		if a.ctx.Err() != nil || !st.whileLive(nil) {
			return
		}
		a.limit.log(a.log, "remembered-list-failed", "cannot list the remembered entities of a shard; retrying", "shard", n, "err", err)
		if !wait.Sleep(a.ctx, backoff) {
			return
		}
	}
	started := 0
	for _, id := range ids {
		start := func() {
			if a.host.Start(n, id) {
				a.stats.Restarted.Add(1)
			}
		}
		if !a.pace.wait(a.ctx) || !st.whileLive(start) {
			break
		}
		started++
	}
	if len(ids) > 0 {
		a.log.Debug("started remembered entities", "shard", n, "entities", started, "of", len(ids), "took", time.Since(began).String())
	}
}

// remembered lists the remembered entities of shard n: those recorded
// under its number, and, for a child of a split, those recorded under its
// ancestors' numbers before the split; of a type that was split, only
// those that belong to n now (a parent's keys from before the split are
// its children's entities too: docs/PROTOCOL.md, Resharding).
func (a *Agent) remembered(ctx context.Context, n int) ([]string, error) {
	layout := a.layoutNow()
	var ids []string
	for _, t := range layout.Tokens(n) {
		got, err := a.cfg.Remember.RememberedEntities(ctx, t)
		if err != nil {
			return nil, err
		}
		for _, id := range got {
			if layout.ShardOf(id) == n { // a parent's key may be a child's entity
				ids = append(ids, id)
			}
		}
	}
	return ids, nil
}

// Passivate stops entity id of shard once the message it handles is done
// (an entity calls it about itself, through natshard's Env.Passivate),
// and, with Config.Remember, forgets it: it is not started again after a
// move. The messages queued after it, and those that come later, go to a
// new incarnation (Akka's Passivate).
func (a *Agent) Passivate(shard int, id string) { a.host.Passivate(shard, id) }
