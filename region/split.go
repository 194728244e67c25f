package region

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/protocol"
)

// A split (docs/PROTOCOL.md, Resharding): the coordinator tells every
// region that the type splits to Count shards (protocol.CmdSplit). The
// region checks the count against the stored configuration (CheckSplit:
// a forged command cannot split it), and, once every shard it holds is
// live, splits them all in one step: each held shard p keeps its number
// and gives the region its children p + from, p + 2*from, ... The children
// listen on p's subjects too; the entities of p that now belong to a child
// stop (host.evict) and the child serves them once they have, holding
// what arrives for it meanwhile. The answer comes once the children's
// subscriptions are flushed.

// CheckSplit: read the stored configuration and report whether its
// layout splits to Count (SplitChecked).
type CheckSplit struct {
	ID    uint64
	Count int
}

// SplitChecked: the outcome of a CheckSplit; Layout is the stored layout
// up to Count.
type SplitChecked struct {
	ID     uint64
	Layout protocol.Layout
	Err    error
}

// SplitShards: route by Layout from now on; give each of Parents (held,
// live) its Children (of the same index, with their Lives), which hold
// what arrives until the parent's entities that are now theirs have
// stopped, then report CaughtUp. Flush, then report Bound with ID.
type SplitShards struct {
	ID       uint64
	Layout   protocol.Layout
	Parents  []int
	Children [][]int
	Lives    [][]uint64
}

func (SplitChecked) isEvent() {}
func (CheckSplit) isAction()  {}
func (SplitShards) isAction() {}

// splitCommand takes the split command: checked against the stored
// configuration first (CheckSplit), unless the region routes by that
// count already.
func (c *Core) splitCommand(id uint64, cmd protocol.Command, reply *protocol.Reply, answer func(error)) {
	switch cur := c.cfg.Shards; {
	case cmd.Count == cur:
		answer(nil)
	case cmd.Count < cur || cmd.Count%cur != 0:
		answer(fmt.Errorf("split to %d shards refused: the region routes by %d", cmd.Count, cur))
	default:
		if c.splitting == nil {
			c.splitting = map[uint64]protocol.Reply{}
		}
		c.splitting[id] = *reply
		c.emit(CheckSplit{ID: id, Count: cmd.Count})
	}
}

// splitChecked splits the held shards once the stored configuration said
// so, if every one of them is live: else the answer names those that are
// not (Replaying), and the coordinator asks again.
func (c *Core) splitChecked(ev SplitChecked) {
	reply, ok := c.splitting[ev.ID]
	if !ok {
		return
	}
	delete(c.splitting, ev.ID)
	answer := func(err error) {
		if err != nil {
			reply.Error = err.Error()
		}
		reply.Held = c.held()
		c.emit(Answer{ID: ev.ID, Reply: reply})
	}
	from, to := c.cfg.Shards, ev.Layout.Shards()
	switch {
	case ev.Err != nil:
		answer(ev.Err)
		return
	case to == from:
		answer(nil) // split meanwhile
		return
	case c.closed:
		answer(errors.New("region is closing"))
		return
	case !c.registered:
		answer(errNotRegistered)
		return
	case c.suspended:
		answer(errSuspended)
		return
	}
	for _, n := range c.held() {
		if s := c.shards[n]; s.mode != modeLive || s.suspended {
			reply.Replaying = append(reply.Replaying, n)
		}
	}
	if len(reply.Replaying) > 0 {
		c.log(slog.LevelInfo, "split waits for shards that are not live yet", "to", to, "shards", reply.Replaying)
		answer(nil)
		return
	}
	act := SplitShards{ID: ev.ID, Layout: ev.Layout}
	for _, p := range c.held() {
		var kids []int
		var lives []uint64
		for _, k := range ev.Layout.Children(p, from)[1:] {
			c.life++
			c.shards[k] = &coreShard{mode: modeHold, life: c.life}
			kids, lives = append(kids, k), append(lives, c.life)
		}
		act.Parents, act.Children, act.Lives = append(act.Parents, p), append(act.Children, kids), append(act.Lives, lives)
	}
	c.cfg.Shards = to
	c.binds[ev.ID] = reply // answered by Bound, once the children's subscriptions are flushed
	c.emit(act)
	c.log(slog.LevelInfo, "split the shards held: each gives its children to this region", "from", from, "to", to, "shards", len(act.Parents))
}

// checkSplit reads the stored configuration from the stream leader and
// returns its layout up to count, or why it does not split to count.
func (a *Agent) checkSplit(count int) (protocol.Layout, error) {
	ctx, cancel := context.WithTimeout(a.ctx, epochCheckTimeout)
	defer cancel()
	cfg, err := a.cfg.Store.Config(ctx)
	if err != nil {
		return protocol.Layout{}, fmt.Errorf("cannot check the split to %d shards against the stored configuration: %w", count, err)
	}
	layout, err := cfg.Layout()
	if err != nil {
		return protocol.Layout{}, fmt.Errorf("the stored configuration: %w", err)
	}
	counts := layout.Counts()
	i := slices.Index(counts, count)
	if i < 0 {
		return protocol.Layout{}, fmt.Errorf("split to %d shards refused: the stored configuration's counts are %s", count, layout)
	}
	if a.cfg.Stream != nil {
		// The children's subjects are added to their message streams
		// before this region forwards to them (splitDurable), and so
		// before the coordinator, once every region answered, announces
		// the count to publishers. A failure is the answer: the
		// coordinator asks again (kvstate.Stream.Extend).
		ctx, cancel := context.WithTimeout(a.ctx, extendTimeout)
		defer cancel()
		if err := a.cfg.Stream.Extend(ctx, count); err != nil {
			return protocol.Layout{}, fmt.Errorf("split to %d shards: the message streams cannot take the new shards yet: %w", count, err)
		}
	}
	return protocol.NewLayout(counts[:i+1]...)
}

// extendTimeout bounds the update of the message streams at a split: one
// update per stream, each a round of the stream's Raft group on a cluster.
const extendTimeout = 30 * time.Second

// splitShards carries out a SplitShards (core delivery; durable delivery:
// splitDurable). Under the locks of
// every parent, the children are registered on their subscriptions (the
// parents', and their own), and then every subscription of the region
// routes by the new layout: each of a parent's messages goes either to
// the parent (before: dispatch holds its lock) or to its entity's child
// (after), never both, never neither. Then the parents' entities that are
// now the children's stop, and each child serves once they have.
func (a *Agent) splitShards(act SplitShards) {
	if a.cfg.Stream != nil {
		a.splitDurable(act)
		return
	}
	layout := act.Layout
	_, kids, evictions, errs := split(a, act, "core", func(k int, life uint64) *shardState {
		ctx, cancel := context.WithCancel(a.ctx)
		return &shardState{a: a, n: k, lifeN: life, mode: modeHold, ctx: ctx, cancel: cancel, bound: time.Now()}
	}, func(parents []*shardState, kids [][]*shardState) (errs []error) {
		a.subsMu.Lock()
		defer a.subsMu.Unlock()
		for i, p := range parents {
			for _, st := range kids[i] {
				// Late copies of what the parent's replay delivered are
				// skipped by the children too.
				st.seen = maps.Clone(p.seen)
				if st.seen == nil {
					st.seen = make(map[string]struct{})
				}
				if err := a.subscribeLocked(st, layout); err != nil {
					errs = append(errs, err)
				}
			}
		}
		for _, ss := range a.subs {
			ss.relayout(layout)
		}
		a.layout.Store(&layout)
		return errs
	})
	a.goDo(func() { a.childrenLive(evictions, kids) })
	a.goDo(func() {
		err := errors.Join(errs...)
		if ferr := a.cfg.Conn.Flush(); ferr != nil {
			err = errors.Join(err, fmt.Errorf("flush subscriptions: %w", ferr))
		}
		a.post(Bound{ID: act.ID, Err: err})
	})
}

// splitIntake is what split needs of a shard's intake.
type splitIntake interface {
	intake
	num() int
	locker() sync.Locker
}

func (st *shardState) num() int             { return st.n }
func (st *shardState) locker() sync.Locker  { return &st.mu }
func (ss *streamShard) num() int            { return ss.n }
func (ss *streamShard) locker() sync.Locker { return &ss.mu }

// split does what a SplitShards asks of both deliveries: it makes the
// children of each parent held here in delivery (as child makes them, held
// from now on), calls under with every parent's lock held, where the
// region starts routing by the new layout, then starts the eviction of the
// entities each parent gives its children (evictions[i], of parents[i],
// whose children are kids[i]).
func split[T splitIntake](a *Agent, act SplitShards, delivery string, child func(n int, life uint64) T, under func(parents []T, kids [][]T) []error) (parents []T, kids [][]T, evictions []<-chan struct{}, errs []error) {
	for i, p := range act.Parents {
		parent, ok := a.shards[p].(T)
		if !ok {
			errs = append(errs, fmt.Errorf("shard %d: not held in %s delivery", p, delivery))
			continue
		}
		ks := make([]T, len(act.Children[i]))
		for j, k := range act.Children[i] {
			ks[j] = child(k, act.Lives[i][j])
			a.shards[k] = ks[j]
		}
		parents, kids = append(parents, parent), append(kids, ks)
	}
	for _, p := range parents {
		p.locker().Lock()
	}
	errs = append(errs, under(parents, kids)...)
	for _, p := range parents {
		p.locker().Unlock()
	}
	layout := act.Layout
	evictions = make([]<-chan struct{}, len(parents))
	for i, p := range parents {
		n := p.num()
		evictions[i] = a.host.Evict(n, func(id string) bool { return layout.ShardOf(id) != n })
	}
	return parents, kids, evictions, errs
}

// SplitLive: the children of a split whose parents' leaving entities have
// stopped: each goes live (as CaughtUp), in one step for all of them (a
// region of 1 365 shards splits them at once: one event each made the
// driver publish its view 1 365 times).
type SplitLive struct {
	Shards []int
	Lives  []uint64
}

func (SplitLive) isEvent() {}

// childrenLive waits for the evictions of a split (evictions[i] is the
// eviction of the parent whose children are kids[i]) and reports the
// children of those done, together, as they end.
func (a *Agent) childrenLive(evictions []<-chan struct{}, kids [][]*shardState) {
	left := len(evictions)
	done := make([]bool, left)
	for left > 0 {
		first := slices.Index(done, false)
		select {
		case <-evictions[first]:
		case <-a.ctx.Done():
			return
		}
		var ev SplitLive
		for i, ch := range evictions {
			if done[i] {
				continue
			}
			select {
			case <-ch:
			default:
				continue
			}
			done[i] = true
			left--
			for _, st := range kids[i] {
				ev.Shards, ev.Lives = append(ev.Shards, st.n), append(ev.Lives, st.lifeN)
			}
		}
		a.post(ev)
	}
}

// splitDurable carries out a SplitShards in durable delivery. Each child
// has a consumer of its own subject; a message on a parent's subject for
// an entity that is now a child's is forwarded by the parent's owner onto
// the child's subject (streamShard.forward), so a child's entities get all
// their messages from the child's consumer, in its stream order, and the
// entity's applied sequence keeps working. Under the locks of every
// parent the region routes by the new layout: each message a parent pulls
// is either delivered (before) or forwarded (after). Then the parents'
// entities that are now the children's stop (after what they were given),
// each parent acknowledges synchronously what it handled (confirm: none
// of those can be forwarded later, as a copy of a new sequence that the
// entity would apply again), and the children get their consumers and go
// live.
func (a *Agent) splitDurable(act SplitShards) {
	layout := act.Layout
	parents, kids, evictions, errs := split(a, act, "durable", func(k int, life uint64) *streamShard {
		return &streamShard{a: a, n: k, lifeN: life, mode: modeHold}
	}, func([]*streamShard, [][]*streamShard) []error {
		a.layout.Store(&layout)
		return nil
	})
	a.goDo(func() { a.durableChildrenLive(parents, evictions, kids) })
	a.post(Bound{ID: act.ID, Err: errors.Join(errs...)})
}

// durableChildrenLive waits for each parent's eviction, confirms what the
// parent handled, gives each of its children a new consumer and reports
// them live (SplitLive), a parent's children at a time. A child whose
// consumer cannot be made is tried again while the region runs.
func (a *Agent) durableChildrenLive(parents []*streamShard, evictions []<-chan struct{}, kids [][]*streamShard) {
	for i, p := range parents {
		select {
		case <-evictions[i]:
		case <-a.ctx.Done():
			return
		}
		ctx, cancel := context.WithTimeout(a.ctx, settleWait)
		if err := p.confirm(ctx); err != nil {
			// Not fatal: the parent's next acknowledgements carry it. A
			// crash before them may give a message handled here to a
			// child again (docs/PROTOCOL.md, Resharding).
			a.log.Warn("a split could not confirm what a parent shard handled", "shard", p.n, "err", err)
		}
		cancel()
		var ev SplitLive
		for _, st := range kids[i] {
			if !st.is(modeHold) {
				continue // dropped meanwhile: its consumer is its owner's
			}
			for backoff := wait.RetryFirst; ; backoff = wait.Next(backoff) {
				cons, err := a.cfg.Stream.ResetConsumer(a.ctx, st.n)
				if err == nil {
					st.cons = cons
					break
				}
				a.limit.log(a.log, "reset-failed", "cannot make a child shard's consumer; retrying", "shard", st.n, "err", err)
				if !wait.Sleep(a.ctx, backoff) {
					return
				}
			}
			ev.Shards, ev.Lives = append(ev.Shards, st.n), append(ev.Lives, st.lifeN)
		}
		a.post(ev)
	}
}
