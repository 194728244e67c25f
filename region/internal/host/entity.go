package host

import (
	"context"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

// Entity is one addressable object. A region calls Handle with one message
// at a time, in arrival order, from whichever goroutine runs the entity at
// that moment; different entities run concurrently. Stop is called exactly
// once, after the last Handle, when the entity is passivated (idle) or its
// shard leaves the region; it is the place to persist state. The context of
// Stop is bounded by the stop timeout.
type Entity interface {
	// Handle processes one message. When the message is a request, the
	// returned bytes are the reply. A non-nil error is sent as the reply's
	// Natshard-Error header, with the returned bytes (or, when nil, a JSON
	// {"ok":false,"error":...}) as the body; on a plain publish it is logged.
	Handle(ctx context.Context, m *Message) ([]byte, error)
	// Stop releases the entity.
	Stop(ctx context.Context) error
}

// Factory creates the entity for id on its first message (or its first
// message after passivation). It may load state. An error is answered to
// the message that caused the activation and the next message tries again.
type Factory func(ctx context.Context, id string) (Entity, error)

// Message is a message delivered to an entity. It is valid during Handle
// only: the region reuses it for a later message once Handle returned, so
// an entity that keeps something of it after Handle keeps its fields
// (Data, Header, ...), never the *Message.
type Message struct {
	EntityID string
	Shard    int
	Subject  string
	Reply    string // empty for a plain publish
	Header   nats.Header
	Data     []byte
	// Seq is the message's sequence in the type's stream in durable
	// delivery (0 in core delivery): a message given again after a crash
	// has the same. SeqFrom reads it from Handle's context.
	Seq uint64

	timer string // the timer that sent it (Timer)
}

// Key is the message's idempotency key, "" if it has none: its
// Nats-Msg-Id, or the reply subject of a request whose sender marked it
// unique (protocol.MessageKey), as natshard's Client does for its core
// requests, which carry no header. A copy of the message that a handoff
// made is skipped by it; a message sent again after a failure has the
// same key only if its sender gave it the same (the Client does, to a
// request it sends again within one call).
func (m *Message) Key() string { return protocol.MessageKey(m.Header, m.Reply) }

// IdempotencyKey is the key its sender gave the message so that it is
// applied once however often it is sent (natshard's MsgID: its
// Nats-Msg-Id, protocol.IdempotencyKey), "" if it has none. The region
// keeps the entity's answer to it and answers the message sent again
// with that key with the same, without calling Handle (AnswerKeeper); a
// persistent entity saves the answer with its state to keep that promise
// across moves and crashes.
func (m *Message) IdempotencyKey() string { return protocol.IdempotencyKey(m.Header) }

// Reminder is the name of the reminder that sent the message (durable
// delivery: natshard's Env.Remind), "" for any other message.
func (m *Message) Reminder() string {
	if m.Header == nil {
		return ""
	}
	return m.Header.Get(protocol.HeaderReminder)
}
