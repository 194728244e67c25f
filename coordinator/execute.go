package coordinator

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// This file holds how a leader carries out the core's actions: the
// table writes (batched, fenced by the lease), the commands to regions,
// the ends of parkings and the end markers written for dead sources.

// execute carries out actions in order. Table writes are synchronous and
// fenced: a refused write ends the term. Consecutive writes go as one
// batch (writeShards, up to kvstate.MaxShardBatch), which the next action
// that may depend on them waits for (waitsForWrites). Commands run
// concurrently and report back through l.results.
func (l *leader) execute(ctx context.Context, acts []Action) error {
	var unparks []Unpark
	var writes []protocol.ShardRecord // not written yet
	// Fences are logged once per call at INFO, each shard's at DEBUG: a
	// takeover or a dead source can fence dozens of shards at once.
	var fenced, fencing []int
	defer func() {
		if len(fenced) > 0 {
			l.log.Info("fenced handoffs' sources in their shards' buffers: what they append from now on is not replayed", "shards", fenced)
		}
		if len(fencing) > 0 {
			l.log.Info("fencing the handoffs of sources that died in their shards' buffers, then writing their end markers", "shards", fencing)
		}
	}()
	flush := func() error {
		err := l.writeShards(ctx, writes)
		writes = writes[:0]
		return err
	}
	for _, a := range acts {
		if w, ok := a.(WriteShard); ok {
			// A full batch goes at once: it is as large as one can be,
			// and waitsForWrites looks through what is held.
			if len(writes) == kvstate.MaxShardBatch {
				if err := flush(); err != nil {
					return err
				}
			}
			writes = append(writes, w.Record)
			continue
		}
		if waitsForWrites(a, writes) {
			if err := flush(); err != nil {
				return err
			}
		}
		switch a := a.(type) {
		case WriteConfig:
			if err := l.renewIfDue(ctx); err != nil {
				return err
			}
			if _, err := l.cfg.Store.PutConfig(ctx, l.lease, a.Config); err != nil {
				return fmt.Errorf("%w: write the type's configuration: %w", errStepDown, err)
			}
			layout := l.core.Layout()
			l.parker.setLayout(layout)
			l.track.grow(layout.Shards())
			ev := protocol.Event{Kind: protocol.EventSplit}
			if a.Config.To != 0 {
				ev.State, ev.Shards = "committed", a.Config.To
				l.splitAt = time.Now()
				l.log.Info("split recorded: each shard's children go to its region; every region is asked to split", "from", a.Config.Shards, "to", a.Config.To)
			} else {
				ev.State, ev.Shards = "announced", a.Config.Shards
				args := []any{"shards", a.Config.Shards, "history", a.Config.History}
				if !l.splitAt.IsZero() {
					args = append(args, "took", duration(time.Since(l.splitAt)))
				}
				l.log.Info("split announced: every region split; clients use the new count", args...)
			}
			l.publish(ev)
		case WritePin:
			ev := protocol.Event{Kind: protocol.EventPin, Shard: &a.Shard, Region: a.Region}
			var err error
			if a.Region != "" {
				_, err = l.cfg.Store.PutPin(ctx, l.lease, a.Shard, a.Region)
			} else {
				err = l.cfg.Store.DeletePin(ctx, l.lease, a.Shard)
				ev.Kind = protocol.EventUnpin
			}
			if err != nil {
				return fmt.Errorf("%w: write pin of shard %d: %w", errStepDown, a.Shard, err)
			}
			l.log.Info(ev.Kind, "shard", a.Shard, "region", a.Region)
			l.publish(ev)
		case Send:
			if a.Command.Kind == protocol.CmdBind {
				for _, sh := range a.Command.Shards {
					l.parker.binding(sh) // before the target can subscribe
				}
			}
			go l.send(ctx, a)
		case RemoveRegion:
			switch err := l.cfg.Store.RemoveRegion(ctx, a.ID, a.Revision); {
			case err == nil:
				l.removed[a.ID] = true
			case errors.Is(err, kvstate.ErrConflict):
				l.log.Debug("a silent region's registration changed since its silence began (renewed, or removed already): not removed", "region", a.ID)
			default:
				l.log.Warn("cannot remove dead region's registration", "region", a.ID, "err", err)
			}
		case StepDown:
			return fmt.Errorf("%w: %s", errStepDown, a.Reason)
		case Park:
			if l.cfg.Durable {
				continue // the stream keeps the shard's messages
			}
			if a.Fence != 0 {
				// Before the parking's first append, and bounded: the
				// leader's loop waits for it. A fence that cannot be
				// written ends the term rather than let the parking's
				// messages precede a zombie's in the buffer; the next
				// term finds the move where this one left it.
				fctx, cancel := context.WithTimeout(ctx, l.cfg.CommandTimeout)
				_, err := l.cfg.Buffer.Fence(fctx, a.Shard, a.Fence)
				cancel()
				if err != nil {
					return fmt.Errorf("%w: fence handoff %d of shard %d: %w", errStepDown, a.Fence, a.Shard, err)
				}
				l.log.Debug("fenced a handoff's source in the shard's buffer: what it appends from now on is not replayed", "shard", a.Shard, "handoff", a.Fence)
				fenced = append(fenced, a.Shard)
			}
			if a.Adopt {
				l.parker.adopt(a.Shard, a.Handoff, l.info.Epoch)
				continue
			}
			if err := l.parker.park(a.Shard, a.Handoff, l.info.Epoch); err != nil {
				return fmt.Errorf("%w: park shard %d: %w", errStepDown, a.Shard, err)
			}
		case Unpark:
			if l.cfg.Durable {
				go l.post(ctx, Unparked{Shard: a.Shard, Handoff: a.Handoff}) // no end marker: the new owner waits for none
				continue
			}
			unparks = append(unparks, a)
		case Mark:
			if l.cfg.Durable {
				go l.post(ctx, Marked{Shard: a.Shard, Handoff: a.Handoff})
				continue
			}
			if a.Fence {
				fencing = append(fencing, a.Shard)
			}
			go l.mark(ctx, a)
		case Warn:
			l.log.Warn(a.Msg)
		case RoundPlanned:
			l.roundAt = time.Now()
			l.log.Info("rebalance round", "round", a.Round, "moves", len(a.Moves), "from_to", movesSummary(a.Moves), "regions", countsSummary(a.Regions))
			l.log.Debug("rebalance round's moves", "round", a.Round, "shards", shardsOf(a.Moves))
		case RoundDone:
			args := []any{"round", a.Round, "moved", a.Moved, "took", duration(time.Since(l.roundAt))}
			if a.Dropped > 0 {
				args = append(args, "dropped", a.Dropped, "why", a.Reason)
			}
			l.log.Info("rebalance round done", args...)
		case NoRound:
			level := slog.LevelInfo
			if a.Settling {
				level = slog.LevelDebug
			}
			l.log.Log(ctx, level, "no rebalance round", "reason", a.Reason)
		}
	}
	if err := flush(); err != nil {
		return err
	}
	if len(unparks) > 0 {
		go l.unpark(ctx, unparks)
	}
	return nil
}

// waitsForWrites reports whether action a must wait for the table writes
// before it: all but log lines, the Park of another shard (a Park starts
// diverting a shard's messages, whatever the other rows say) and an
// Unpark (execute gathers them and starts them after its last writes) do.
func waitsForWrites(a Action, writes []protocol.ShardRecord) bool {
	switch a := a.(type) {
	case Warn, RoundPlanned, RoundDone, NoRound, Unpark:
		return false
	case Park:
		return slices.ContainsFunc(writes, func(r protocol.ShardRecord) bool { return r.Shard == a.Shard })
	}
	return true
}

// writeShards writes rows of the table (at most kvstate.MaxShardBatch):
// as one batch where the store has them go as one (kvstate.Store.Batches)
// and the server takes it, else one row after another. Before the batch,
// and before each row, it renews the lease when that is due: under load
// a row alone took a quarter of a second, and 22 of them outlasted a 4 s
// lease that nothing renewed meanwhile (the server expired it; the rest
// were refused as fenced, and the term ended).
func (l *leader) writeShards(ctx context.Context, recs []protocol.ShardRecord) error {
	if len(recs) == 0 {
		return nil
	}
	if l.cfg.Store.Batches(len(recs)) {
		if err := l.renewIfDue(ctx); err != nil {
			return err
		}
		err := l.cfg.Store.PutShards(ctx, l.lease, recs)
		if err == nil {
			l.written(recs)
			return nil
		}
		if !errors.Is(err, kvstate.ErrBatchRefused) {
			return fmt.Errorf("%w: write %d shards from shard %d: %w", errStepDown, len(recs), recs[0].Shard, err)
		}
		l.log.Debug("the table's rows go one at a time", "rows", len(recs), "why", err)
	}
	for i := range recs {
		if err := l.renewIfDue(ctx); err != nil {
			return err
		}
		if _, err := l.cfg.Store.PutShard(ctx, l.lease, recs[i]); err != nil {
			return fmt.Errorf("%w: write shard %d: %w", errStepDown, recs[i].Shard, err)
		}
		l.written(recs[i : i+1])
	}
	return nil
}

// written records rows of the table just written: for the moves' timing,
// the log and the event stream.
func (l *leader) written(recs []protocol.ShardRecord) {
	now := time.Now()
	for _, rec := range recs {
		l.track.written(rec, now)
		l.log.Debug("shard", "shard", rec.Shard, "region", rec.Region, "state", rec.State)
		l.publish(protocol.Event{Kind: protocol.EventShard, Shard: &rec.Shard, State: string(rec.State), Region: rec.Region, Source: rec.Source})
	}
}

// unpark ends the parking of shards whose new owner is replaying their
// buffer: after the grace period (so that the owner's subscription is known
// to every server of a cluster), it unsubscribes and appends the end
// markers, then reports each shard Unparked. The buffer of a shard whose
// owner was live already (Unpark.Live) is purged instead. (Ending 32
// shards at a time made no difference that three runs of
// BenchmarkRegions could see: docs/bench-log/scaling.md.)
func (l *leader) unpark(ctx context.Context, us []Unpark) {
	if !wait.Sleep(ctx, l.cfg.ReleaseGrace) {
		return // the term ended: the next one parks the shards again, or stops parking them
	}
	for _, u := range us {
		l.parker.unsubscribe(u.Shard, u.Handoff, l.info.Epoch)
	}
	for _, u := range us {
		done := false
		if u.Live {
			done = l.purgeRetrying(ctx, u.Shard)
		} else {
			done = l.markRetrying(ctx, u.Shard, u.Handoff)
		}
		if done {
			l.post(ctx, Unparked{Shard: u.Shard, Handoff: u.Handoff})
		}
	}
}

// purgeRetrying empties a shard's buffer once the appends of its parking
// are acknowledged: everything in it is a copy of what its live owner
// handled (the owner purged up to its own end marker before it went live).
func (l *leader) purgeRetrying(ctx context.Context, shard int) bool {
	for ctx.Err() == nil {
		err := l.cfg.Buffer.Flush(ctx)
		if err == nil {
			err = l.cfg.Buffer.Purge(ctx, shard, math.MaxUint64)
		}
		if err == nil {
			l.log.Info("purged a parked shard's buffer: its owner was live already", "shard", shard)
			return true
		}
		l.log.Warn("cannot purge a parked shard's buffer; retrying", "shard", shard, "err", err)
		wait.Sleep(ctx, 500*time.Millisecond)
	}
	return false
}

// mark appends an end marker for a source that died.
func (l *leader) mark(ctx context.Context, m Mark) {
	if m.Fence && !l.fenceRetrying(ctx, m.Shard, m.Handoff) {
		return
	}
	if l.markRetrying(ctx, m.Shard, m.Handoff) {
		l.post(ctx, Marked{Shard: m.Shard, Handoff: m.Handoff})
	}
}

func (l *leader) markRetrying(ctx context.Context, shard int, handoff uint64) bool {
	for ctx.Err() == nil {
		if _, err := l.cfg.Buffer.Mark(ctx, shard, handoff); err == nil {
			return true
		} else {
			l.log.Warn("cannot write an end marker; retrying", "shard", shard, "handoff", handoff, "err", err)
		}
		wait.Sleep(ctx, 500*time.Millisecond)
	}
	return false
}

// fenceRetrying fences handoff in shard's buffer (kvstate.Buffer.Fence),
// retrying until it is written or ctx ends.
func (l *leader) fenceRetrying(ctx context.Context, shard int, handoff uint64) bool {
	for ctx.Err() == nil {
		if _, err := l.cfg.Buffer.Fence(ctx, shard, handoff); err == nil {
			l.log.Debug("fenced a handoff's source in the shard's buffer: what it appends from now on is not replayed", "shard", shard, "handoff", handoff)
			return true
		} else {
			l.log.Warn("cannot fence a handoff's source in the shard's buffer; retrying", "shard", shard, "handoff", handoff, "err", err)
		}
		wait.Sleep(ctx, 500*time.Millisecond)
	}
	return false
}

func (l *leader) post(ctx context.Context, ev Event) {
	select {
	case l.events <- ev:
	case <-ctx.Done():
	}
}

func (l *leader) send(ctx context.Context, s Send) {
	done := CommandDone{Send: s, Outcome: Failed}
	data, err := protocol.Encode(s.Command)
	if err == nil {
		var m *nats.Msg
		rctx, cancel := context.WithTimeout(ctx, l.cfg.CommandTimeout)
		m, err = l.cfg.Conn.RequestWithContext(rctx, l.cfg.Subjects.Region(s.Region), data)
		cancel()
		switch {
		case errors.Is(err, nats.ErrNoResponders):
			done.Outcome = NoResponders
		case err != nil:
		case protocol.Decode(m.Data, &done.Reply) != nil:
			err = errors.New("undecodable reply")
		case done.Reply.Error != "":
			done.Outcome = Refused
		default:
			done.Outcome = OK
		}
	}
	if err != nil || done.Outcome == Refused {
		l.log.Debug("command", "kind", s.Command.Kind, "region", s.Region, "outcome", done.Outcome, "err", err, "refusal", done.Reply.Error)
	}
	l.post(ctx, done)
}
