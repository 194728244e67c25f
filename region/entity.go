package region

import (
	"context"

	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/region/internal/host"
)

// The entity's side of the region: the types are the entity runtime's
// (internal/host), named here so that users of region need no other
// package.

// Entity is one addressable object. A region calls Handle with one message
// at a time, in arrival order, from whichever goroutine runs the entity at
// that moment; different entities run concurrently. Stop is called exactly
// once, after the last Handle, when the entity is passivated (idle) or its
// shard leaves the region; it is the place to persist state. The context of
// Stop is bounded by the stop timeout.
//
// Handle processes one message. When the message is a request, the
// returned bytes are the reply. A non-nil error is sent as the reply's
// Natshard-Error header, with the returned bytes (or, when nil, a JSON
// {"ok":false,"error":...}) as the body; on a plain publish it is logged.
type Entity = host.Entity

// Flusher is an Entity that stores the effect of a run of its messages
// of durable delivery in one write (group commit): Handle applies such a
// message in memory when WillFlush(ctx), and the region calls Flush, then
// answers and
// acknowledges the run's messages; a failed Flush drops the incarnation
// and the run is handled again, one message at a time. The rule, its
// bound (MaxRun) and its errors are documented in internal/host.
type Flusher = host.Flusher

// MaxRun is the most messages of one Flusher's run (host.MaxRun).
const MaxRun = host.MaxRun

// WillFlush reports, from Handle's context, whether the entity's Flush
// follows this Handle before the message is answered or acknowledged
// (host.WillFlush): only then may Handle leave its write to Flush.
func WillFlush(ctx context.Context) bool { return host.WillFlush(ctx) }

// Factory creates the entity for id on its first message (or its first
// message after passivation). It may load state. An error is answered to
// the message that caused the activation and the next message tries again.
type Factory = host.Factory

// Message is a message delivered to an entity. It is valid during Handle
// only: the region reuses it for a later message once Handle returned, so
// an entity that keeps something of it after Handle keeps its fields
// (Data, Header, ...), never the *Message. Its methods (Key,
// IdempotencyKey, Reminder, Timer) are documented in internal/host.
type Message = host.Message

// ErrUnavailable marks an error of an entity (or its Factory) that may
// pass if the message is tried again: what kvstate returns when JetStream
// does not answer. In durable delivery such a message is given to the
// entity again instead of being answered with the error.
var ErrUnavailable = kvstate.ErrUnavailable

// SeqFrom returns the stream sequence of the message being handled, from
// the context given to an entity's Handle (and to its Factory, for the
// message that activates it) in durable delivery; 0 in core delivery.
// Persistent entities save it with their state and skip a message they
// were given again (after a crash) at or below the one they applied.
func SeqFrom(ctx context.Context) uint64 { return host.SeqFrom(ctx) }
