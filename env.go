package natshard

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region"
)

// Env is an entity's environment. A Factory reads it with EnvFrom and
// keeps what its entity needs.
type Env struct {
	Type   string // the entity type's name
	ID     string // the entity's id
	Shard  int    // the entity's shard
	Region string // the region (process) that hosts it now
	// Delivery is the type's delivery mode: in Durable, each message's
	// stream sequence is SeqFrom(ctx), and reminders work.
	Delivery Delivery
	// Store holds the persisted state of the type's entities; LoadState
	// reads and writes the entity's through it, with compare-and-set.
	Store StateStore
	// Conn is the node's NATS connection, Client a client on it: an
	// entity may send to other entities (never to itself and wait: it
	// handles one message at a time).
	Conn   *nats.Conn
	Client *Client

	log *slog.Logger
	h   *hosted
	// answers are the saved answers of the States loaded for the entity
	// (LoadState): its region asks them (answering) before it gives the
	// entity a message with an idempotency key.
	answers []func(key string) (region.KeptAnswer, bool)
}

// answering is an entity whose States save answers (UpdateAnswer): the
// region finds those through it (region.AnswerKeeper).
type answering struct {
	Entity
	answers []func(key string) (region.KeptAnswer, bool)
}

func (a answering) Answer(key string) (region.KeptAnswer, bool) {
	for _, f := range a.answers {
		if ans, ok := f(key); ok {
			return ans, true
		}
	}
	return region.KeptAnswer{}, false
}

// keeper returns ent, made a region.AnswerKeeper of the answers of the
// States its Factory loaded, unless it is one already.
func (e *Env) keeper(ent Entity) Entity {
	if len(e.answers) == 0 || ent == nil {
		return ent
	}
	if _, ok := ent.(region.AnswerKeeper); ok {
		return ent
	}
	return answering{Entity: ent, answers: e.answers}
}

// Logger returns the node's logger with the entity's type, region and id.
func (e *Env) Logger() *slog.Logger {
	return e.log.With("type", e.Type, "region", e.Region, "entity", e.ID)
}

// Passivate stops the entity once the message it handles is done (its
// Stop hook runs), and, if the type remembers its entities
// (Type.Remember), forgets it: it is not started again after a move or a
// restart. Messages queued after that one, and later ones, activate a new
// incarnation (the Factory runs again), as Akka's Passivate. An entity
// calls it about itself, from Handle or its Factory.
func (e *Env) Passivate() {
	if e.h != nil && e.h.agent != nil {
		e.h.agent.Passivate(e.Shard, e.ID)
	}
}

// Remind schedules a message with data to the entity at time at (at once
// if at has passed), which its Handle gets with Message.Reminder() ==
// name. A reminder is kept in the type's stream by the NATS server
// (JetStream message schedules, nats-server 2.12 or later), so it
// survives crashes, moves and restarts, and comes once: it is delivered
// like any message of durable delivery (State applies it once). A
// reminder of the same name replaces the entity's earlier one. name is
// 1 to 64 letters, digits, '-' or '_'. It returns once the reminder is
// stored; ErrNotDurable in core delivery.
func (e *Env) Remind(ctx context.Context, name string, at time.Time, data []byte) error {
	if e.h == nil || e.h.stream == nil {
		return ErrNotDurable
	}
	if err := e.h.stream.Remind(ctx, e.reminderShard(), e.ID, name, at, data); err != nil {
		return fmt.Errorf("natshard: %w", err)
	}
	return nil
}

// RemindAfter is Remind at the time d from now.
func (e *Env) RemindAfter(ctx context.Context, name string, d time.Duration, data []byte) error {
	return e.Remind(ctx, name, time.Now().Add(d), data)
}

// CancelReminder removes the entity's reminder name if it has not come
// yet (nothing happens if there is none); ErrNotDurable in core delivery.
func (e *Env) CancelReminder(ctx context.Context, name string) error {
	if e.h == nil || e.h.stream == nil {
		return ErrNotDurable
	}
	if err := e.h.stream.CancelReminder(ctx, e.reminderShard(), e.ID, name); err != nil {
		return fmt.Errorf("natshard: %w", err)
	}
	return nil
}

// reminderShard is the shard number under which the entity's reminders
// are kept: its shard under the type's first count, which no split
// changes, so that a reminder set again after a split replaces the one set
// before, and a cancel finds it. A reminder comes on that shard's subject;
// its owner forwards it down to the entity's shard (docs/PROTOCOL.md,
// Resharding).
func (e *Env) reminderShard() int {
	if e.h.agent == nil {
		return e.Shard
	}
	return protocol.ShardOf(e.ID, e.h.agent.Layout().Counts()[0])
}

// SeqFrom returns the stream sequence of the message being handled, from
// the context an entity's Handle (or its Factory, for the message that
// activates it) is given, in durable delivery; 0 in core delivery. A
// message given again after a crash has the same: State saves it with the
// state and applies such a message once.
func SeqFrom(ctx context.Context) uint64 { return region.SeqFrom(ctx) }

// WillFlush reports, from the context given to Handle, whether the
// region calls the entity's Flush after this Handle and before the
// message is answered or acknowledged: a message of durable delivery to
// an entity that implements Flusher. Only then may Handle apply the
// message in memory and leave its write to Flush; otherwise (core
// delivery, or an entity wrapped in one that does not pass Flush on) it
// stores the change itself.
func WillFlush(ctx context.Context) bool { return region.WillFlush(ctx) }

type envKey struct{}

// EnvFrom returns the environment of the entity being activated, from the
// context a Factory is given; nil for any other context.
func EnvFrom(ctx context.Context) *Env {
	e, _ := ctx.Value(envKey{}).(*Env)
	return e
}

func withEnv(ctx context.Context, e *Env) context.Context {
	return context.WithValue(ctx, envKey{}, e)
}
