package host

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// run runs a cell for its worker. It takes the cell's whole mailbox at
// once (a batch: the cell gets *spare, empty, for what comes meanwhile),
// handles it one message at a time without the shard's lock, and takes
// the next batch, until the mailbox is empty: it returns false, the cell
// no longer running. When it has handled turnBudget messages and more are
// queued it returns true: the cell stays running and the caller queues
// it again. At the end of a shard stop it also stops the entity and
// removes the cell.
func (h *Host) run(t task, w *workerState) (again bool) {
	se, c, id, shard := t.se, t.c, t.id, t.se.n
	var (
		counts msgCounts // handled since the last time se.mu was taken
		budget = turnBudget
		mq     = w.spare // the batch's mailbox, the cell's before
		batch  = mq.q[:0]
	)
	if t.first.m != nil {
		batch = append(batch, t.first)
	}
	// The running cell is this worker's: no other goroutine writes its
	// entity, so reading it needs no lock.
	ent := c.entity
	for {
		calls := h.passivateCalls.Load()
		for i := range batch {
			e := batch[i]
			batch[i] = envelope{}
			budget--
			if e.m == nil {
				ent = h.startOne(se, id, ent)
			} else {
				if len(w.run) > 0 && !joinsRun(w.run, e) {
					var failed uint64
					ent, failed = h.endRun(se, id, c, ent, w)
					counts.failed += failed
				}
				counts.handled++
				var err error
				if ent, err = h.deliverOne(se, id, c, ent, e, &w.msg, &w.run); err != nil {
					counts.failed++
				}
				if n := len(w.run); n > 0 && (n >= MaxRun || ent == nil) {
					var failed uint64
					ent, failed = h.endRun(se, id, c, ent, w)
					counts.failed += failed
				}
			}
			if ent == nil {
				h.dropTimers(se, c) // the incarnation ended (a panic) or never began
			}
			if rest := batch[i+1:]; len(rest) > 0 && h.passivateCalls.Load() != calls {
				// Some entity asked to stop: if it is this one, the rest
				// of the batch goes back in front of the mailbox, for the
				// next incarnation.
				calls = h.passivateCalls.Load()
				se.mu.Lock()
				if c.passivate {
					mb := c.box()
					mb.q = append(slices.Clone(rest), mb.q...)
					clear(rest)
					se.mu.Unlock()
					break
				}
				se.mu.Unlock()
			}
		}
		if len(w.run) > 0 {
			// The run ends with the batch: what it applied is stored,
			// then answered and acknowledged.
			var failed uint64
			ent, failed = h.endRun(se, id, c, ent, w)
			counts.failed += failed
		}
		w.msg = Message{} // what the batch's last Handle saw is not kept
		batch = batch[:0]
		mq.q = batch

		handled := counts.handled > 0
		var now int64
		if handled {
			now = h.now()
		}
		se.mu.Lock()
		c.entity = ent
		if handled {
			c.lastActive = now
			se.counts.add(counts)
			counts = msgCounts{}
		}
		if c.passivate && ent != nil && !se.closing {
			// The entity asked to stop: it stops now, and a new
			// incarnation handles the messages queued or to come.
			forget := c.remembered && h.forget != nil
			c.passivate, c.remembered = false, false
			if se.timers != nil {
				h.dropTimersLocked(se, c)
			}
			if forget && !se.restarted {
				if se.forgotten == nil {
					se.forgotten = make(map[string]struct{})
				}
				se.forgotten[id] = struct{}{}
			}
			c.stop = stopRunning // a timer started by the Stop hook is refused
			se.mu.Unlock()
			h.stopEntity(shard, id, ent)
			se.mu.Lock()
			c.stop = stopNone
			if h.limit != nil && c.mailbox.len() > 0 {
				// The next incarnation is counted at once: a check
				// during Stop may have detached the entry (as stopCell).
				h.touchLimit(se, c, id, true)
			}
			se.mu.Unlock()
			h.passivations.Add(1)
			if forget {
				h.forget(shard, id)
			}
			ent = nil
			continue
		}
		if c.mailbox.len() == 0 {
			if (se.closing || c.evict) && ent != nil {
				// Deliveries are refused now, so the mailbox stays empty.
				// An entity that asked to stop is forgotten; the others
				// stay remembered, for the shard's next owner.
				forget := c.passivate && c.remembered && h.forget != nil
				if se.timers != nil {
					h.dropTimersLocked(se, c)
				}
				se.mu.Unlock()
				h.stopEntity(shard, id, ent)
				if forget {
					h.forget(shard, id)
				}
				se.mu.Lock()
				ent, c.entity = nil, nil
			}
			c.running = false
			// The idle cell keeps no mailbox; the worker keeps one.
			freeMailq(c.mailbox)
			c.mailbox = nil
			if ent == nil {
				h.removeLocked(se, id, c)
			}
			se.mu.Unlock()
			w.keep(mq)
			return false
		}
		if budget <= 0 {
			se.mu.Unlock()
			w.keep(mq)
			return true
		}
		// Swap: the cell's mailbox is the next batch; the cell gets the
		// empty one, unless nothing comes for it meanwhile.
		mq, c.mailbox = c.mailbox, mq
		batch = mq.q
		se.mu.Unlock()
	}
}

// startOne creates the remembered entity id unless ent exists, and
// returns the entity (nil when the Factory failed: logged, and the
// entity's next message tries again).
func (h *Host) startOne(se *shardEntities, id string, ent Entity) Entity {
	if ent != nil {
		return ent
	}
	ent, err := h.create(se.ctx, se.n, id)
	if err != nil {
		h.log.Warn("region: a remembered entity could not be started; its next message tries again", "shard", se.n, "entity", id, "error", err)
		return nil
	}
	return ent
}

// deliverOne gives the message e to entity id, creating the entity first
// when ent is nil, answers it, and returns the entity (nil when it has to
// be created again: it panicked, or could not be created).
//
// A message of durable delivery is done (acknowledged) once answered.
// When the entity (or its Factory) fails with ErrUnavailable (its state
// could not be read or written: JetStream has no leader for a moment) or
// ErrConflict (its state's revision was not the one it held, and again
// after a reload), it is not answered: the entity gets it again after a
// pause, before any later message, until it succeeds or the shard leaves
// this region (then it stays in the stream for the next owner).
//
// With run not nil, a message of durable delivery to a Flusher is
// handled in memory and appended to *run (neither answered nor
// acknowledged: endRun does it once Flush stored the run), and nil is
// returned; when its Handle panicked and the run holds messages before
// it, it joins the run too, and the nil entity returned makes the run
// fail (endRun). With run nil, a Flusher's message is flushed alone
// before it is answered.
//
// It returns the error the message was answered with.
func (h *Host) deliverOne(se *shardEntities, id string, c *cell, ent Entity, e envelope, msg *Message, run *[]pending) (_ Entity, err error) {
	ctx, shard := se.ctx, se.n
	if e.d != nil && ctx.Err() != nil {
		// The shard left (AbortShard): the message stays in the stream
		// for its next owner, and so does every later one, so that
		// none is acknowledged after one that was not.
		return ent, ctx.Err()
	}
	if e.timer != nil {
		// A timer's message: handled only if its timer is still due, and
		// dropped silently when the region stalled since it was queued.
		if !h.takeTimer(se, c, id, e.timer) || h.stalls != nil && h.stalls(true) != e.stalls {
			return ent, nil
		}
	} else if h.stalls != nil && e.d == nil {
		// Queued before the region stalled: the shard may have been given
		// to another region meanwhile. It waits for the region's verdict
		// on the shard (Deliver). (Durable delivery's stream keeps the
		// message for its owner.)
		if now := h.stalls(true); now != e.stalls && !h.confirmedAfter(se, now) {
			if ctx.Err() != nil {
				// Let go without a handoff (AbortShard): its next holder
				// may have a copy (a replay's, from the buffer it leaves)
				// and answer it, so a refusal could be false.
				h.refusedStopping.Add(1)
				h.droppedStopping.warn(h, "region: a message queued before a stall dropped unanswered: its shard left the region", "shard", shard, "entity", id)
				return ent, errShardNotServed
			}
			h.refuse(shard, id, e.m)
			return ent, errShardNotServed
		}
	}
	if h.trace != nil && e.m.Header != nil {
		var end func(error)
		if ctx, end = h.trace(ctx, e.m); end != nil {
			defer func() { end(err) }()
		}
	}
	var (
		seq  uint64
		base = ctx // without the sequence
	)
	if e.d != nil {
		_, flushes := ent.(Flusher)
		ctx, seq = withSeq(base, e.d.seq, flushes), e.d.seq
	}
	var (
		key string // the message's idempotency key, or the key it asks the answer of
		ask bool   // it asks for the answer of key (protocol.HeaderAnswerOf)
	)
	if e.m.Header != nil {
		key, ask = answerKey(e.m.Header)
	}
	backoff := wait.RetryFirst
	conflicts := 0
	for {
		var (
			data     []byte
			deferred bool // handled in memory, stored by the run's Flush
			kept     bool // Handle answered it: its answer is kept under key
		)
		if ent == nil {
			if err = h.rememberOnce(ctx, se, id, c); err != nil {
				err = fmt.Errorf("remember entity: %w", err)
			} else if ent, err = h.create(ctx, shard, id); err != nil {
				err = fmt.Errorf("create entity: %w", err)
			}
		}
		if ent != nil {
			var (
				fl      Flusher
				flushes bool // stored by Flush before it is answered
			)
			if e.d != nil {
				if fl, flushes = ent.(Flusher); flushes != WillFlush(ctx) {
					ctx = withSeq(base, seq, flushes) // the entity was created here
				}
			}
			deferred = flushes && run != nil
			recalled := false
			if key != "" {
				// A key applied already is answered as the first
				// time, and not handled.
				ans, ok, panicked := h.recall(se, c, ent, key)
				switch {
				case panicked:
					data, err, recalled, ent = nil, errEntityPanicked, true, nil // as a panic in Handle
				case ok:
					data, err, recalled = ans.Data, ans.err(), true
				case ask:
					data, err, recalled = nil, Refused(protocol.RefusedNoAnswer, errNoAnswer), true
				}
			}
			if !recalled {
				var ok bool
				if data, ok, err = h.handle(ctx, shard, id, ent, e.m, seq, e.timer, msg); !ok {
					ent = nil // panicked: drop this incarnation without Stop
				} else if flushes && !deferred && !transient(err) {
					// A run of one: stored before it is answered.
					if ferr := h.flush(se, id, fl); ferr != nil {
						// Its change is not stored: the incarnation
						// that holds it goes, a new one loads the state.
						h.log.Warn("region: an entity could not store the change of a message of durable delivery", "shard", shard, "entity", id, "error", ferr)
						h.dropTimers(se, c)
						if ctx.Err() != nil {
							return nil, ferr // the shard left: the message stays in the stream
						}
						ent, data, err = nil, nil, ferr
						if errors.Is(ferr, kvstate.ErrConflict) && conflicts == 0 {
							conflicts++ // someone else wrote: once more, from theirs
							continue
						}
					}
				}
				kept = ent != nil && key != "" && !ask && !transient(err)
				if kept && !deferred {
					h.keep(se, c, key, data, err)
				}
			}
		}
		if e.d != nil && (errors.Is(err, kvstate.ErrUnavailable) || errors.Is(err, kvstate.ErrConflict)) {
			// Not the entity's verdict on the message: its state could
			// not be stored (no answer from JetStream, or a revision
			// other than the one held, twice). Acknowledged with the
			// error, the message's effect would be lost.
			if backoff == wait.RetryFirst {
				h.log.Warn("region: an entity could not handle a message of durable delivery; it gets it again", "shard", shard, "entity", id, "error", err)
			}
			if ctx.Err() != nil || !wait.Sleep(ctx, backoff) {
				if deferred && len(*run) > 0 {
					// The run before it must not be stored without
					// it: it fails (endRun), acknowledging nothing.
					return nil, err
				}
				return ent, err // the shard left: the message stays in the stream
			}
			backoff = wait.Next(backoff)
			continue
		}
		if deferred && (ent != nil || len(*run) > 0) {
			k := key
			if ask {
				k = ""
			}
			*run = append(*run, pending{e: e, data: data, err: err, key: k, keep: kept})
			return ent, nil
		}
		h.reply(shard, id, e.m, data, err)
		if e.d != nil {
			if err != nil && h.log.Enabled(ctx, slog.LevelDebug) {
				// Acknowledged all the same: the error is the answer.
				h.log.Debug("region: a message of durable delivery was answered with an error", "shard", shard, "entity", id, "seq", e.d.seq, "error", err)
			}
			e.d.done()
		} else if e.done != nil {
			e.done()
		}
		return ent, err
	}
}

// rememberOnce records entity id before its first activation, with
// Config.Remember.
func (h *Host) rememberOnce(ctx context.Context, se *shardEntities, id string, c *cell) error {
	if h.remember == nil {
		return nil
	}
	se.mu.Lock()
	known := c.remembered
	se.mu.Unlock()
	if known {
		return nil
	}
	if err := h.remember(ctx, se.n, id); err != nil {
		return err
	}
	se.mu.Lock()
	c.remembered = true
	se.mu.Unlock()
	return nil
}

type seqKey struct{}

// seqValue is what withSeq puts in a context: the message's stream
// sequence, and whether the entity's Flush follows its Handle.
type seqValue struct {
	seq   uint64
	flush bool
}

func withSeq(ctx context.Context, seq uint64, flush bool) context.Context {
	return context.WithValue(ctx, seqKey{}, seqValue{seq: seq, flush: flush})
}

// WillFlush reports, from the context given to an entity's Handle,
// whether the runtime calls the entity's Flush after this Handle and
// before the message is answered or acknowledged: a message of durable
// delivery to an entity that implements Flusher. Handle may then apply
// the message in memory only and leave its write to Flush; otherwise it
// stores its change itself (core delivery, or an entity wrapped in one
// that does not implement Flusher).
func WillFlush(ctx context.Context) bool {
	v, _ := ctx.Value(seqKey{}).(seqValue)
	return v.flush
}

// SeqFrom returns the stream sequence of the message being handled, from
// the context given to an entity's Handle (and to its Factory, for the
// message that activates it) in durable delivery; 0 in core delivery.
// Persistent entities save it with their state and skip a message they
// were given again (after a crash) at or below the one they applied.
func SeqFrom(ctx context.Context) uint64 {
	v, _ := ctx.Value(seqKey{}).(seqValue)
	return v.seq
}

// create calls the Factory; a panic is recovered (logged, and returned as
// errEntityPanicked).
func (h *Host) create(ctx context.Context, shard int, id string) (ent Entity, err error) {
	defer func() {
		if r := recover(); r != nil {
			h.log.Error("region: entity factory panicked",
				"shard", shard, "entity", id, "panic", fmt.Sprint(r), "stack", string(debug.Stack()))
			ent, err = nil, errEntityPanicked
		}
	}()
	ent, err = h.factory(ctx, id)
	if err == nil && ent == nil {
		err = errors.New("entity factory returned no entity")
	}
	if err != nil {
		return nil, err
	}
	h.activations.Add(1)
	return ent, nil
}

// handle runs ent.Handle for m and returns its answer. ok is false when
// Handle panicked (err is errEntityPanicked then). msg is the worker's
// Message, filled for the call (run clears it after each batch: clearing
// it after each message took about 7 ns in a profile of shardctl bench).
func (h *Host) handle(ctx context.Context, shard int, id string, ent Entity, m *nats.Msg, seq uint64, timer *timerFire, msg *Message) (data []byte, ok bool, err error) {
	defer func() {
		if r := recover(); r != nil {
			h.log.Error("region: entity panicked",
				"shard", shard, "entity", id, "subject", m.Subject, "panic", fmt.Sprint(r), "stack", string(debug.Stack()))
			data, ok, err = nil, false, errEntityPanicked
		}
	}()
	*msg = Message{
		EntityID: id,
		Shard:    shard,
		Subject:  m.Subject,
		Reply:    m.Reply,
		Header:   m.Header,
		Data:     m.Data,
		Seq:      seq,
	}
	if timer != nil {
		msg.timer = timer.name
	}
	data, err = ent.Handle(ctx, msg)
	return data, true, err
}

// reply answers a request; for a plain publish it only logs an error.
func (h *Host) reply(shard int, id string, m *nats.Msg, data []byte, err error) {
	if m.Reply == "" {
		if err != nil {
			h.log.Debug("region: entity error on a publish",
				"shard", shard, "entity", id, "subject", m.Subject, "error", err)
		}
		return
	}
	if tooLarge := Answer(h.conn, m, data, err); tooLarge != nil {
		h.tooLarge.warn(h, "region: an answer was too large to send", "subject", m.Subject, "err", tooLarge)
	}
}

// refuse answers a message delivered to a shard that is being stopped.
func (h *Host) refuse(shard int, id string, m *nats.Msg) {
	h.refusedStopping.Add(1)
	if m.Reply == "" {
		h.droppedStopping.warn(h, "region: message to a stopping shard dropped",
			"shard", shard, "entity", id, "subject", m.Subject)
		return
	}
	h.reply(shard, id, m, nil, errShardNotServed)
}
