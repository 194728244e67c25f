package natshard

import (
	"errors"

	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/region"
	"github.com/natshard/natshard/send"
)

// The errors of natshard, returned wrapped: test with errors.Is. Several
// are another package's under a name of this one (the sending half lives
// in package send, which a program that only sends imports without
// linking the NATS server).

// Errors of a Node.
var (
	// ErrClosed: the node was stopped or closed already.
	ErrClosed = errors.New("natshard: node closed")
	// ErrConnectionClosed: the node's NATS connection was closed under
	// it (a connection given in Options.Conn closed by its owner, or one
	// that gave up reconnecting).
	ErrConnectionClosed = errors.New("natshard: the NATS connection was closed")
	// ErrRegionInUse: another live process serves the node's region id
	// for one of its types.
	ErrRegionInUse = region.ErrRegionInUse
	// ErrConfigMismatch: a Type disagrees with what its type stores (the
	// shard count, the strategy or the entity kind).
	ErrConfigMismatch = kvstate.ErrConfigMismatch
)

// ErrStartTimeout: Start waited Options.StartTimeout for JetStream and it
// stayed unavailable. The error names what was waited for, how long, and
// the last attempt's error (a kvstate.ErrUnavailable).
var ErrStartTimeout = errors.New("natshard: start timeout")

// Errors of Healthy and Ready.
var (
	// ErrNotReady wraps why Ready found the node not ready.
	ErrNotReady = errors.New("natshard: not ready")
	// ErrUnhealthy wraps why Healthy found the node unhealthy.
	ErrUnhealthy = errors.New("natshard: unhealthy")
)

// Errors of persisted state, returned wrapped; test with errors.Is.
var (
	// ErrNotFound: an entity has no persisted state.
	ErrNotFound = kvstate.ErrNotFound
	// ErrConflict: a compare-and-set failed: the state's revision is not
	// the one the writer held (another writer came first). In durable
	// delivery it is handled as ErrUnavailable: the message is given again.
	ErrConflict = kvstate.ErrConflict
	// ErrUnavailable: NATS or JetStream did not answer (a timeout, a
	// leader election). In durable delivery, a message whose entity (or
	// Factory) returns an error wrapping it is given to the entity again,
	// before its later messages, instead of being answered with the error
	// and consumed: State's errors wrap it when they should.
	ErrUnavailable = kvstate.ErrUnavailable
)

// ErrNotActive: a timer was started for an entity that is not active
// here (any more): from its Stop hook, or through an Env that outlived
// its activation. A timer is started by the entity itself, from its
// Factory or Handle.
var ErrNotActive = region.ErrNotActive

// ErrNotDurable: reminders need durable delivery (Type.Delivery =
// Durable): in core delivery nothing keeps them across a crash or a move.
// An entity of core delivery that needs a timer starts one
// (Env.StartTimer): in memory, lost when the entity stops.
var ErrNotDurable = errors.New("natshard: reminders need durable delivery (Type.Delivery = Durable)")

// Errors of sending (package send).
var (
	// ErrUnknownType: the type has no KV bucket on the NATS servers the
	// client reaches: no node ever hosted it (or it was deleted).
	ErrUnknownType = send.ErrUnknownType
	// ErrNoAnswer: a request sent again with the key of a message its
	// entity applied already could not be answered as the first time
	// (send.ErrNoAnswer).
	ErrNoAnswer = send.ErrNoAnswer
	// ErrBadRequest: a typed entity's request could not be decoded (code
	// "bad-request").
	ErrBadRequest = send.ErrBadRequest
)
