package region

import (
	"context"
	"fmt"
	"maps"
	"sync/atomic"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/fanin"
	"github.com/natshard/natshard/protocol"
)

// The region's subscriptions to the data plane (core delivery).
//
// A region has one subscription per data subject, shard.<type>.<t>.>, and
// the shards it holds register on the subjects they listen on (routes): a
// shard of a type never split listens on its own subject only, so each
// subscription has one shard; a child of a split listens on its
// ancestors' subjects too (protocol.Layout.Tokens), where its parent, or a
// sibling held here, may listen as well (docs/PROTOCOL.md, Resharding).
// Each message is parsed once, by its subscription, and handed to the held
// shard its entity belongs to under the type's count; a message of an
// entity whose shard is not held here is another region's, and ignored.
//
// A region splits its shards on the very subscriptions they had: the
// route of a subscription changes under the lock of the shard that holds
// it, so each message of it goes either to the parent (before) or to its
// entity's child (after), never both, never neither.
//
// A shard's message from a newer subject is handed to the shard only once
// its older subjects' subscriptions have handled what they received
// before it (fanin), so that a publisher that switches to the new count
// keeps its order.

// subjectSub is the region's subscription to the subject of token.
type subjectSub struct {
	token  int
	sub    *fanin.Sub
	routes atomic.Pointer[routeSet]
}

// routeSet is what a subscription does with its messages: the layout to
// parse them by, and the held shards that listen on it. A routes value is
// never changed: a change stores a new one.
type routeSet struct {
	layout protocol.Layout
	shards map[int]*shardState
}

// onSubject is the callback of subscription ss: it parses the message,
// finds the held shard its entity belongs to and hands the message to it
// (dispatch). It runs on the subscription's goroutine.
func (a *Agent) onSubject(ss *subjectSub, m *nats.Msg) {
	if hook := a.onArrival.Load(); hook != nil {
		(*hook)(m)
	}
	for {
		r := ss.routes.Load()
		token, shard, id, err := r.layout.ParseEntity(a.cfg.Subjects, m.Subject)
		if err != nil {
			a.malformed(m, err)
			return
		}
		st := r.shards[shard]
		if st == nil {
			return // the entity's shard is held elsewhere: its region has this subject too
		}
		for _, older := range st.subs {
			if older == ss {
				break
			}
			_ = older.sub.CaughtUp(a.ctx)
		}
		if a.dispatch(st, ss, r, id, m, token != shard) {
			return
		}
		// The routes changed meanwhile (a split): route it again.
	}
}

// subscribeShard registers st on each subject its shard listens on under
// layout, subscribing the subjects the region has no subscription to yet.
// The caller flushes the connection. (The subjects of st are set once,
// here.)
func (a *Agent) subscribeShard(st *shardState, layout protocol.Layout) error {
	a.subsMu.Lock()
	defer a.subsMu.Unlock()
	return a.subscribeLocked(st, layout)
}

// subscribeLocked is subscribeShard, a.subsMu held. A subscription the
// region has already keeps routing by its layout (a split changes them
// all at once: relayout); a new one routes by layout.
//
// st.subs is set before st is routed on any of them: a subscription's
// callback reads it (onSubject) once it finds st in the routes, and the
// routes' atomic store is what orders the two (a message that came
// between the routing and the assignment raced on it: CI, 2026-11-29).
func (a *Agent) subscribeLocked(st *shardState, layout protocol.Layout) error {
	var subs []*subjectSub
	for _, t := range layout.Tokens(st.n) {
		ss, err := a.subjectLocked(t, layout)
		if err != nil {
			for _, s := range subs {
				a.unrouteLocked(s, st) // ends a subscription made here for st
			}
			return fmt.Errorf("subscribe shard %d: %w", st.n, err)
		}
		subs = append(subs, ss)
	}
	st.subs = subs
	for _, ss := range subs {
		ss.route(st, true)
	}
	return nil
}

// subjectLocked returns the region's subscription to token's subject,
// subscribing it (with no shard) if there is none; a.subsMu is held.
func (a *Agent) subjectLocked(token int, layout protocol.Layout) (*subjectSub, error) {
	if ss := a.subs[token]; ss != nil {
		return ss, nil
	}
	ss := &subjectSub{token: token}
	ss.routes.Store(&routeSet{layout: layout})
	sub, err := fanin.Subscribe(a.cfg.Conn, a.cfg.Subjects.Shard(token), func(m *nats.Msg) { a.onSubject(ss, m) })
	if err != nil {
		return nil, err
	}
	ss.sub = sub
	a.subs[token] = ss
	return ss, nil
}

// route adds st to ss's shards (or removes it).
func (ss *subjectSub) route(st *shardState, add bool) {
	old := ss.routes.Load()
	shards := maps.Clone(old.shards)
	if shards == nil {
		shards = map[int]*shardState{}
	}
	if add {
		shards[st.n] = st
	} else if shards[st.n] == st {
		delete(shards, st.n)
	}
	ss.routes.Store(&routeSet{layout: old.layout, shards: shards})
}

// relayout makes ss route by layout (a split).
func (ss *subjectSub) relayout(layout protocol.Layout) {
	ss.routes.Store(&routeSet{layout: layout, shards: ss.routes.Load().shards})
}

// unrouteLocked removes st from ss, and ends the subscription when no
// shard listens on it any more (what it still held is discarded: the
// shards it was for are gone); a.subsMu is held.
func (a *Agent) unrouteLocked(ss *subjectSub, st *shardState) {
	ss.route(st, false)
	if len(ss.routes.Load().shards) == 0 && a.subs[ss.token] == ss {
		delete(a.subs, ss.token)
		_ = ss.sub.Unsubscribe()
	}
}

// unsubscribeShard takes st off its subscriptions at once (drop, fence,
// close): a message of it that they still hold is ignored (another
// region's, or nobody's: the coordinator parks the shard).
func (a *Agent) unsubscribeShard(st *shardState) {
	a.subsMu.Lock()
	defer a.subsMu.Unlock()
	for _, ss := range st.subs {
		a.unrouteLocked(ss, st)
	}
}

// drainShard takes st off its subscriptions once each has handed it
// everything it received before the call (a released source: what reached
// it before the release grace ended must still be buffered; what comes
// after, the new owner has), and ends it (modeGone): a message its
// subscriptions were handing it meanwhile is routed again, to nobody, and
// ignored, never appended after the end marker that follows. A
// subscription no other shard listens on is ended.
func (a *Agent) drainShard(ctx context.Context, st *shardState) {
	ctx, cancel := context.WithTimeout(ctx, drainTimeout)
	defer cancel()
	for _, ss := range st.subs {
		if err := ss.sub.CaughtUp(ctx); err != nil && a.ctx.Err() == nil {
			a.log.Warn("a released shard's subscription did not hand over what it held in time; cut", "shard", st.n, "subject", ss.token, "err", err)
		}
	}
	st.mu.Lock()
	a.unsubscribeShard(st)
	st.mode = modeGone
	st.mu.Unlock()
}

// pendingOf is how many messages st's subscriptions hold for their
// callbacks (of every shard that listens on them).
func (st *shardState) pendingOf() int {
	n := 0
	for _, ss := range st.subs {
		if p, _, err := ss.sub.Subscription().Pending(); err == nil {
			n += p
		}
	}
	return n
}
