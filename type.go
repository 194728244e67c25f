package natshard

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/natshard/natshard/internal/passivation"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region"
	"github.com/natshard/natshard/strategies"
)

// Entity is one addressable object of a type. The node calls Handle with
// one message at a time, in arrival order, from whichever goroutine runs
// the entity at that moment; different entities run concurrently. Stop is
// called once, after the last Handle, when the entity is passivated (idle)
// or its shard leaves the process: the place to persist state that was not
// saved as it changed.
//
// Handle's context ends when the entity's shard is dropped from this
// process or the process is fenced (the shard may be served elsewhere
// already), or the node closes. A non-nil error from Handle is sent to a
// requester as an error reply (the Natshard-Error header, and its code in
// Natshard-Error-Code when it is or wraps an *Error; a Client returns an
// *EntityError) with the returned bytes, or {"ok":false,"error":...}
// when they are nil. A typed type (Typed, Key) needs no Entity of its
// own: its Handler gets the requests decoded.
//
// Entity is an alias of region.Entity, an interface of two methods (go
// doc lists no methods of an alias: `go doc
// github.com/natshard/natshard/region.Entity` shows the interface):
//
//	Handle(ctx context.Context, m *Message) ([]byte, error)
//	Stop(ctx context.Context) error
//
// Handle processes one message: for a request the returned bytes are the
// reply; a non-nil error is answered as above, and logged for a plain
// publish; m is valid until Handle returns. Stop releases the entity: it
// is called once, after the last Handle, with a context that ends after
// 10 s (a Stop that outlives it is abandoned, left running).
type Entity = region.Entity

// Flusher is an Entity of durable delivery that stores the effect of
// several of its messages in one write (group commit): an Entity with
// one more method,
//
//	Flush(ctx context.Context) error
//
// When WillFlush(ctx) is true (a message of durable delivery) its Handle
// applies the message in memory only, and Flush stores what the Handle
// calls since the last Flush changed, with the sequence of the last
// message applied (SeqFrom). The region calls Flush after a run of the entity's queued
// messages (at most MaxRun, never waiting for more) and answers and
// acknowledges them only once it succeeded: a message's effect is never
// acknowledged before it is stored. When Flush fails, none of the run is:
// the incarnation is dropped without Stop, and a new one (its Factory
// loads the stored state) handles the run's messages again, one at a
// time, each followed by its own Flush; skipping a message at or below
// the stored sequence makes each take effect once. In core delivery
// Flush is never called and WillFlush is false: Handle stores its change
// itself, as it must when it is wrapped in an entity that does not pass
// Flush on. The built-in
// kv kind is one (docs/GUIDE.md, "Storing many messages in one write").
type Flusher = region.Flusher

// MaxRun is the most messages of a Flusher's run: one worker's turn of an
// entity, so that a message waits for at most that many others to be
// applied in memory before the run's write.
const MaxRun = region.MaxRun

// Message is a message delivered to an entity. It is valid during Handle
// only: the region reuses it for a later message once Handle returned, so
// an entity that keeps something of it after Handle keeps its fields
// (Data, Header, ...), never the *Message. MessageFrom gives it from
// Handle's context.
//
// Message is an alias of region.Message (go doc lists no fields or
// methods of an alias, and `go doc natshard.Message.Key` finds nothing:
// `go doc github.com/natshard/natshard/region.Message` shows them with
// their docs). Its fields:
//
//   - EntityID string: the entity's id.
//   - Shard int: the entity's shard.
//   - Subject string: the subject it was sent to (empty for a timer's
//     message).
//   - Reply string: the reply subject of a request; empty for a plain
//     publish.
//   - Header nats.Header: its headers (nil for a timer's message).
//   - Data []byte: the payload.
//   - Seq uint64: its sequence in the type's stream in durable delivery,
//     0 in core delivery; a message given again after a crash has the
//     same (SeqFrom reads it from Handle's context).
//
// Its methods:
//
//   - Key() string: its key for skipping copies, "" if it has none: its
//     Nats-Msg-Id, or the reply subject of a request its sender marked
//     unique (as the Client does for its core requests). A copy of it
//     that a handoff made is skipped by it.
//   - IdempotencyKey() string: the key its sender gave it so that it is
//     applied once however often it is sent (MsgID, sent as its
//     Nats-Msg-Id), "" if it has none. The region answers the message
//     sent again with that key with the kept answer, without calling
//     Handle (AnswerKeeper, State.UpdateAnswer).
//   - Reminder() string: the name of the reminder that sent it (durable
//     delivery: Env.Remind), "" for any other message.
//   - Timer() string: the name of the entity's timer that sent it
//     (Env.StartTimer), "" for any other message. A timer's message has
//     no subject, reply or header; its Data is the data the timer was
//     started with, shared by each of its messages: do not modify it.
type Message = region.Message

// AnswerKeeper is an Entity that keeps the answers to the keyed messages
// it applied (MsgID) with its state, so that a message sent again with
// its key after a move or a crash is answered with them, not handled
// again: its region asks Answer before Handle. An entity whose Factory
// loads its state with LoadState, and changes it with
// State.UpdateAnswer, needs nothing more; one that saves its own state
// implements it (docs/PROTOCOL.md, "Idempotency keys").
type AnswerKeeper = region.AnswerKeeper

// KeptAnswer is an answer an AnswerKeeper keeps: the body, and the
// error's text for an error answer.
type KeptAnswer = region.KeptAnswer

// Factory activates the entity id of a type on its first message (or its
// first after passivation). It may load state: EnvFrom(ctx) gives the
// entity's environment, LoadState its persisted state. ctx is the
// entity's (see Entity). An error is answered to the message that caused
// the activation, and the next message tries again.
type Factory = func(ctx context.Context, id string) (Entity, error)

// Delivery is how messages reach a type's entities (Type.Delivery).
type Delivery string

// Delivery modes.
const (
	Core    Delivery = protocol.DeliveryCore
	Durable Delivery = protocol.DeliveryDurable
)

// Passivation policies of the active-entity limit (Type.PassivationPolicy).
const (
	// PassivationWTinyLFU, the default: an admission window (LRU, 1 % of
	// the limit) before a segmented LRU (80 % protected) whose entities a
	// newcomer displaces only when a frequency sketch counts it more
	// often; Akka Cluster Sharding's default strategy, without its
	// adaptive window. Entities used once pass without displacing the
	// frequent ones.
	PassivationWTinyLFU = passivation.WTinyLFU
	// PassivationLRU passivates the least recently used first.
	PassivationLRU = passivation.LRU
)

// Type is an entity type hosted by a Node: its name, its entities, and its
// knobs. A zero field means the value the type stores (for the shard
// count, the strategy and the kind) or else the default (Default*); every
// process of a type must agree on what the type stores, and a process that
// disagrees refuses to start.
type Type struct {
	// Name of the type: its subjects are shard.<Name>.<shard>.<id>, its
	// state is in the KV bucket natshard_<Name>.
	Name string
	// Entity is the factory of the type's entities. Required.
	Entity Factory
	// Kind names what the entities are, so that a process hosting other
	// entities under the same type name cannot join it and answer in
	// their place; stored with the type. The default is Name. shardd's
	// built-in kinds are "kv", "echo" and "trace".
	Kind string
	// Shards is the shard count, stored: DefaultShards for a new type.
	Shards int
	// Strategy is the allocation strategy's spec (strategies.Parse, for
	// example "consistent-hashing:virtual-nodes=100"), stored:
	// DefaultStrategy for a new type.
	Strategy string
	// Delivery is how messages reach the type's entities, stored: Core
	// (core NATS; a crash loses what was in flight: Akka's semantics) for
	// a new type, or Durable (every message is stored in the type's
	// JetStream stream before any entity gets it, and leaves it once its
	// entity handled it: a crash or a lost NATS server loses nothing that
	// the stream acknowledged). docs/PROTOCOL.md, "Durable delivery".
	Delivery Delivery
	// Replicas of the type's KV bucket and buffer stream (and durable
	// message stream) when they are created (3 on a NATS cluster). Zero
	// means the size of the node's embedded cluster, at most 3, with
	// ServerOptions.Cluster; else DefaultReplicas. Existing ones are used
	// as they are.
	Replicas int
	// IdleTimeout passivates entities idle this long; Off never.
	IdleTimeout time.Duration
	// MaxActive caps the entities active in this process's region of the
	// type: beyond it, the idle entities PassivationPolicy values least
	// are passivated, within 100 ms (Akka's active-entity limit). 0
	// means no limit. Not stored: each process sets its own. Ignored
	// with Remember, whose entities are never passivated but on request.
	MaxActive int
	// PassivationPolicy chooses the entities MaxActive passivates:
	// PassivationWTinyLFU ("w-tinylfu", the default, as "") or
	// PassivationLRU ("lru"). Not stored.
	PassivationPolicy string
	// HandOffTimeout: how long a region may take to pause a shard before
	// the coordinator reallocates it.
	HandOffTimeout time.Duration
	// RebalanceInterval between the strategy's rounds; Off runs none (moves
	// then happen on membership changes and shardctl's requests).
	RebalanceInterval time.Duration
	// MaxMoves bounds the moves of live shards in flight.
	MaxMoves int
	// BufferSize bounds the messages buffered per shard while it moves;
	// beyond it they are refused visibly.
	BufferSize int
	// MinRegions: no shard is allocated before this many regions
	// registered.
	MinRegions int
	// Remember, stored: the ids of the active entities are recorded, and
	// a shard's new owner starts them again without a message, after a
	// move, a crash or a full restart (Akka's remember-entities). A
	// remembered entity is never passivated for idleness (IdleTimeout
	// must be 0 or Off); it stops when it calls Env.Passivate, and is
	// then forgotten. Its first activation waits for the record (one KV
	// write, batched with the region's others). false means what the
	// type stores.
	Remember bool
	// RestartRate: remembered entities this process starts per second,
	// over all of the type's shards it takes (DefaultRestartRate), so that
	// a restart brings them back without a storm.
	RestartRate int
	// BucketBytes, BufferBytes and StreamBytes bound, in bytes, the
	// type's KV bucket (leases, registrations, the shard table and entity
	// state), its handoff buffer stream and its durable message streams
	// together (StreamBytes is split evenly over them: a stream whose
	// shards get more than their share fills first; docs/OPERATIONS.md,
	// Storage) when they are created (each a JetStream MaxBytes, which the store
	// reserves: a server refuses to create a stream whose limit does not
	// fit in its max_file_store); DefaultBucketBytes, DefaultBufferBytes
	// and DefaultStreamBytes by default, negative for no limit. Existing
	// ones keep theirs. With the limits, a type whose buffer or message
	// stream fills up refuses those messages and keeps renewing its
	// leases, and entity state that fills the bucket is refused before
	// the bucket's last bytes, kept for the leases and the table
	// (docs/OPERATIONS.md, "Storage").
	BucketBytes int64
	BufferBytes int64
	StreamBytes int64

	// daemon: the Type is a Daemon's (Daemon.Type).
	daemon *daemonSpec
}

// withDefaults returns t with every zero field that is not stored set to
// its default, and the stored ones (Shards, Strategy) set to their
// default for a new type. Kind defaults to Name.
func (t Type) withDefaults() Type {
	if t.Kind == "" {
		t.Kind = t.Name
	}
	if t.Shards == 0 {
		t.Shards = DefaultShards
	}
	if t.Strategy == "" {
		t.Strategy = DefaultStrategy
	}
	if t.Delivery == "" {
		t.Delivery = Core
	}
	return t.withLocalDefaults()
}

// withLocalDefaults sets the defaults of the fields that the type does not
// store.
func (t Type) withLocalDefaults() Type {
	if t.Replicas == 0 {
		t.Replicas = DefaultReplicas
	}
	if t.IdleTimeout == 0 && !t.Remember {
		t.IdleTimeout = DefaultIdleTimeout
	}
	if t.HandOffTimeout == 0 {
		t.HandOffTimeout = DefaultHandOffTimeout
	}
	if t.RebalanceInterval == 0 {
		t.RebalanceInterval = DefaultRebalanceInterval
	}
	if t.MaxMoves == 0 {
		t.MaxMoves = DefaultMaxMoves
	}
	if t.BufferSize == 0 {
		t.BufferSize = DefaultBufferSize
	}
	if t.MinRegions == 0 {
		t.MinRegions = DefaultMinRegions
	}
	if t.RestartRate == 0 {
		t.RestartRate = DefaultRestartRate
	}
	if t.PassivationPolicy == "" {
		t.PassivationPolicy = PassivationWTinyLFU
	}
	if t.Remember {
		t.IdleTimeout = Off
	}
	if t.BucketBytes == 0 {
		t.BucketBytes = DefaultBucketBytes
	}
	if t.BufferBytes == 0 {
		t.BufferBytes = DefaultBufferBytes
	}
	if t.StreamBytes == 0 {
		t.StreamBytes = DefaultStreamBytes
	}
	return t
}

// Defaults returns t as a new type would be hosted: every zero field set
// to its default (Kind to Name). A type that exists already keeps its
// stored shard count, strategy and kind instead; Node.Type tells what a
// node applies.
func (t Type) Defaults() Type { return t.withDefaults() }

// validate checks t and names the field at fault. It canonicalises the
// strategy spec.
func (t *Type) validate() error {
	var errs []error
	if err := protocol.ValidateName("Name", t.Name); err != nil {
		errs = append(errs, err)
	}
	if t.Kind != "" {
		if err := protocol.ValidateName("Kind", t.Kind); err != nil {
			errs = append(errs, err)
		}
	}
	if t.Shards < 0 || t.Shards > protocol.MaxShards {
		//lint:ignore ST1005 a Validate error begins with the name of the field at fault, as its others do
		errs = append(errs, fmt.Errorf("Shards: %d is out of range 1..%d (0: stored, or %d)", t.Shards, protocol.MaxShards, DefaultShards))
	}
	if t.Strategy != "" {
		if _, canonical, err := strategies.Parse(t.Strategy); err != nil {
			//lint:ignore ST1005 a Validate error begins with the name of the field at fault, as its others do
			errs = append(errs, fmt.Errorf("Strategy: %w", err))
		} else {
			t.Strategy = canonical
		}
	}
	if t.Delivery != "" && t.Delivery != Core && t.Delivery != Durable {
		errs = append(errs, fmt.Errorf("Delivery: %q is neither %q nor %q", t.Delivery, Core, Durable))
	}
	if t.Replicas < 0 || t.Replicas > 5 {
		//lint:ignore ST1005 a Validate error begins with the name of the field at fault, as its others do
		errs = append(errs, fmt.Errorf("Replicas: %d is out of range 1..5", t.Replicas))
	}
	if t.IdleTimeout < Off {
		errs = append(errs, fmt.Errorf("IdleTimeout: %s is negative (Off never passivates)", t.IdleTimeout))
	}
	if t.HandOffTimeout != 0 && t.HandOffTimeout < time.Second {
		errs = append(errs, fmt.Errorf("HandOffTimeout: %s is shorter than 1s", t.HandOffTimeout))
	}
	if t.RebalanceInterval < Off {
		errs = append(errs, fmt.Errorf("RebalanceInterval: %s is negative (Off runs no round)", t.RebalanceInterval))
	}
	if t.MaxActive < 0 {
		errs = append(errs, fmt.Errorf("MaxActive: %d is negative (0: no limit)", t.MaxActive))
	}
	if err := passivation.Check(t.PassivationPolicy); err != nil {
		errs = append(errs, fmt.Errorf("PassivationPolicy: %w", err))
	}
	if t.MaxMoves < 0 {
		errs = append(errs, fmt.Errorf("MaxMoves: %d is negative", t.MaxMoves))
	}
	if t.BufferSize < 0 {
		errs = append(errs, fmt.Errorf("BufferSize: %d is negative", t.BufferSize))
	}
	if t.MinRegions < 0 {
		errs = append(errs, fmt.Errorf("MinRegions: %d is negative", t.MinRegions))
	}
	if t.RestartRate < 0 {
		errs = append(errs, fmt.Errorf("RestartRate: %d is negative", t.RestartRate))
	}
	if t.Remember && t.MaxActive > 0 {
		errs = append(errs, fmt.Errorf("MaxActive: %d with Remember: remembered entities are passivated only at their own request (Env.Passivate); leave it 0", t.MaxActive))
	}
	if t.Remember && t.IdleTimeout > 0 {
		errs = append(errs, fmt.Errorf("IdleTimeout: %s with Remember: remembered entities are not passivated for idleness (they would be started again); leave it 0 or Off, and have an entity that is done call Env.Passivate", t.IdleTimeout))
	}
	if t.daemon != nil {
		errs = append(errs, t.daemon.validate(*t)...)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("type %q: %w", t.Name, err)
	}
	return nil
}

// ensureConfig agrees on the type's stored configuration: a new type
// stores t's (with the defaults); an existing one must match what t
// gives, and gives what t leaves zero (a shard count the type had before
// a split counts as the stored one: logged on log). It returns t with the
// stored values, and the stored configuration. A bucket just created on a cluster may still elect its leader:
// the caller retries what is only unavailable (startwait.go).
func (t Type) ensureConfig(ctx context.Context, store *kvstate.Store, log *slog.Logger) (Type, protocol.TypeConfig, error) {
	if t.Kind == "" {
		t.Kind = t.Name
	}
	want := protocol.TypeConfig{Shards: t.Shards, Strategy: t.Strategy, Kind: t.Kind, Delivery: string(t.Delivery), Remember: t.Remember}
	stored, err := store.Config(ctx)
	switch {
	case errors.Is(err, kvstate.ErrNotFound):
		d := t.withDefaults()
		want = protocol.TypeConfig{Shards: d.Shards, Strategy: d.Strategy, Kind: d.Kind, Delivery: string(d.Delivery), Remember: d.Remember}
		if d.Delivery == Durable {
			// The type is made now: its messages are split over several
			// streams (docs/PROTOCOL.md, "The consumers' shape").
			want.Streams = kvstate.MessageStreamsFor(d.Shards)
		}
	case err != nil:
		return t, protocol.TypeConfig{}, fmt.Errorf("type %q: read its stored configuration: %w", t.Name, err)
	case want.Shards == 0:
		want.Shards = stored.Shards
	}
	got, err := store.EnsureConfig(ctx, want)
	if errors.Is(err, kvstate.ErrConfigMismatch) {
		switch {
		case got.Shards != want.Shards:
			return t, protocol.TypeConfig{}, fmt.Errorf("type %q: %d shards disagree with the %d stored for the type, which never had %d (its earlier counts: %v); a type's count changes only by a split to a multiple of it (shardctl reshard), never by a process configured otherwise (%w)", t.Name, want.Shards, got.Shards, want.Shards, got.History, err)
		case want.Delivery != "" && got.DeliveryOf() != want.Delivery:
			return t, protocol.TypeConfig{}, fmt.Errorf("type %q: this process is configured with delivery %q, the type's is %q; every process of a type must deliver the same way (%w)", t.Name, want.Delivery, got.DeliveryOf(), err)
		case got.Kind != want.Kind:
			return t, protocol.TypeConfig{}, fmt.Errorf("type %q: this process hosts entity kind %q, the type's entities are of kind %q; every process of a type must host the same kind (%w)", t.Name, want.Kind, got.Kind, err)
		case want.Remember && !got.Remember:
			return t, protocol.TypeConfig{}, fmt.Errorf("type %q: this process remembers the entities (Remember), the type was made without; every process of a type must agree (%w)", t.Name, err)
		default:
			return t, protocol.TypeConfig{}, fmt.Errorf("type %q: strategy %q disagrees with the type's stored strategy %q; every process of a type must use the same strategy (%w)", t.Name, want.Strategy, got.Strategy, err)
		}
	}
	if err != nil {
		return t, protocol.TypeConfig{}, fmt.Errorf("type %q: store its configuration: %w", t.Name, err)
	}
	if want.Shards != got.Shards {
		// A count the type had before a split (or one a split under way
		// goes to): the stored one it is.
		log.Info("the type was resharded: this process takes the stored shard count", "configured", want.Shards, "stored", got.Shards, "history", got.History, "splitting_to", got.To)
	}
	t.Shards, t.Strategy, t.Delivery, t.Remember = got.Shards, got.Strategy, Delivery(got.DeliveryOf()), got.Remember
	if t.Strategy == "" {
		t.Strategy = DefaultStrategy // a bucket from before strategies were stored
	}
	return t.withDefaults(), got, nil
}
