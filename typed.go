package natshard

import (
	"context"
	"errors"
	"fmt"

	"github.com/natshard/natshard/send"
)

// Typed entity types: requests and replies are Go types, encoded by the
// key's codec. A Key (send.Key) names the type with them; Typed serves it
// with a Handler per entity; Key.Ref gives a typed reference whose Ask
// and Tell encode, send and decode. The wire stays plain (the encoded
// request on the entity's subject), and the bytes API stays beside it.

// Key names an entity type with its request and reply types (send.Key).
type Key[Req, Rep any] = send.Key[Req, Rep]

// Ref is a typed reference to one entity (send.Ref).
type Ref[Req, Rep any] = send.Ref[Req, Rep]

// Codec encodes a typed type's requests, replies and error details
// (send.Codec).
type Codec = send.Codec

// KeyOption configures a Key (send.KeyOption).
type KeyOption = send.KeyOption

// Error is an error a type declares, with a code that crosses the wire
// (send.Error).
type Error = send.Error

// Codecs (send.JSON, send.Msgpack).
var (
	JSON    = send.JSON
	Msgpack = send.Msgpack
)

// NewKey returns the key of the entity type name (send.NewKey).
func NewKey[Req, Rep any](name string, opts ...KeyOption) Key[Req, Rep] {
	return send.NewKey[Req, Rep](name, opts...)
}

// WithCodec sets a key's codec (send.WithCodec).
func WithCodec(c Codec) KeyOption { return send.WithCodec(c) }

// NewError returns an error with a code and a message (send.NewError).
func NewError(code, message string) *Error { return send.NewError(code, message) }

// Handler is one entity of a typed type: Handle gets each request
// decoded, one at a time in arrival order (as Entity.Handle), and returns
// the reply, encoded by the key's codec and sent to a requester (nothing
// is sent for a Tell). A returned error is answered as an error: with
// its code (an Error, or an error wrapping one) in the
// Natshard-Error-Code header and its details, encoded, as the body. A
// Handler that also has a method Stop(ctx context.Context) error is
// stopped as an Entity is; MessageFrom(ctx) gives the message being
// handled, and UpdateReply changes a State and keeps the reply for the
// request's idempotency key; a Handler that does so also gives its
// State's Answer method (Answer(key string) (KeptAnswer, bool)), for its
// region to find them before calling Handle.
type Handler[Req, Rep any] interface {
	Handle(ctx context.Context, req Req) (Rep, error)
}

// HandlerFunc is a Handler of a function, for entities without state of
// their own.
type HandlerFunc[Req, Rep any] func(ctx context.Context, req Req) (Rep, error)

// Handle calls f.
func (f HandlerFunc[Req, Rep]) Handle(ctx context.Context, req Req) (Rep, error) {
	return f(ctx, req)
}

// Typed returns the Factory of a typed type: newEntity activates entity
// id as Factory does, and each message is decoded into a Req with key's
// codec (an empty one is the zero Req). A message that does not decode is
// answered with ErrBadRequest (code "bad-request"), without calling
// Handle.
func Typed[Req, Rep any](key Key[Req, Rep], newEntity func(ctx context.Context, id string) (Handler[Req, Rep], error)) Factory {
	codec := key.Codec()
	return func(ctx context.Context, id string) (Entity, error) {
		h, err := newEntity(ctx, id)
		if err != nil {
			return nil, err
		}
		if h == nil {
			return nil, fmt.Errorf("natshard: type %q: the factory of entity %q returned no handler", key.Name(), id)
		}
		return &typedEntity[Req, Rep]{h: h, codec: codec}, nil
	}
}

// TypeOf is the Type of key's name hosting newEntity's handlers (Typed):
// set its other fields before Start.
func TypeOf[Req, Rep any](key Key[Req, Rep], newEntity func(ctx context.Context, id string) (Handler[Req, Rep], error)) Type {
	return Type{Name: key.Name(), Entity: Typed(key, newEntity)}
}

type typedEntity[Req, Rep any] struct {
	h     Handler[Req, Rep]
	codec Codec
}

// typedCall is what a typed entity's Handle context carries: the
// message and the type's codec.
type typedCall struct {
	m     *Message
	codec Codec
}

type typedCallKey struct{}

// MessageFrom is the message a typed entity's Handle (its ctx) is
// handling, nil outside of one.
func MessageFrom(ctx context.Context) *Message {
	c, _ := ctx.Value(typedCallKey{}).(*typedCall)
	if c == nil {
		return nil
	}
	return c.m
}

// UpdateReply is State.UpdateAnswer for a typed entity's Handle (ctx):
// change changes the state and returns the reply, and with an idempotency
// key (MsgID) the reply, encoded, is saved with the state in the same
// compare-and-set, so that the request sent again with its key is
// answered with it whichever process holds the entity then, after a move
// or a crash. Outside a typed Handle it is Update, and keeps no reply.
func UpdateReply[T, Rep any](ctx context.Context, s *State[T], change func(*T) (Rep, error)) (Rep, error) {
	var rep Rep
	c, _ := ctx.Value(typedCallKey{}).(*typedCall)
	if c == nil {
		err := s.Update(ctx, func(v *T) error {
			var err error
			rep, err = change(v)
			return err
		})
		return rep, err
	}
	data, err := s.UpdateAnswer(ctx, c.m, func(v *T) ([]byte, error) {
		r, err := change(v)
		if err != nil {
			return nil, err
		}
		return c.codec.Marshal(r)
	})
	if err != nil {
		return rep, err
	}
	if len(data) > 0 {
		if err := c.codec.Unmarshal(data, &rep); err != nil {
			return rep, fmt.Errorf("natshard: decode the reply kept with the state: %w", err)
		}
	}
	return rep, nil
}

func (e *typedEntity[Req, Rep]) Handle(ctx context.Context, m *Message) ([]byte, error) {
	var req Req
	if len(m.Data) > 0 {
		if err := e.codec.Unmarshal(m.Data, &req); err != nil {
			return nil, ErrBadRequest.Errorf("bad request: %v", err)
		}
	}
	rep, err := e.h.Handle(context.WithValue(ctx, typedCallKey{}, &typedCall{m: m, codec: e.codec}), req)
	if err != nil {
		var declared *Error
		if errors.As(err, &declared) && declared.Details() != nil {
			body, eerr := e.codec.Marshal(declared.Details())
			if eerr == nil {
				return body, err
			}
		}
		return nil, err
	}
	data, err := e.codec.Marshal(rep)
	if err != nil {
		return nil, fmt.Errorf("natshard: encode the reply: %w", err)
	}
	return data, nil
}

// Answer is the handler's, when it keeps answers with its state
// (AnswerKeeper: a method Answer(key string) (KeptAnswer, bool), as
// State.Answer): a request sent again with its key after a move or a
// crash is then answered from it, in durable delivery too (where the
// region asks for an answer without handling anything).
func (e *typedEntity[Req, Rep]) Answer(key string) (KeptAnswer, bool) {
	if k, ok := e.h.(interface {
		Answer(key string) (KeptAnswer, bool)
	}); ok {
		return k.Answer(key)
	}
	return KeptAnswer{}, false
}

func (e *typedEntity[Req, Rep]) Stop(ctx context.Context) error {
	if s, ok := e.h.(interface{ Stop(context.Context) error }); ok {
		return s.Stop(ctx)
	}
	return nil
}
