package send

import (
	"context"
	"errors"
	"fmt"
)

// Key names an entity type with the Go types of its requests and
// replies, and their codec (Akka typed's EntityTypeKey): declare it once,
// in a package that the type's hosts and its senders share, with the
// errors the type answers with (NewError).
//
//	var Account = send.NewKey[account.Request, account.Reply]("account")
//
// A sender asks with Ref; a host serves it with natshard.Typed. The wire
// stays plain: a request is Req encoded by the codec (JSON by default) on
// the entity's subject, so `nats req shard.account.<shard>.<id> '{...}'`
// and a publisher in any language talk to a typed entity too.
type Key[Req, Rep any] struct {
	name  string
	codec Codec
}

// A KeyOption configures a Key.
type KeyOption func(*keyConfig)

type keyConfig struct{ codec Codec }

// WithCodec sets the codec of the key's requests, replies and error
// details (JSON by default).
func WithCodec(c Codec) KeyOption { return func(k *keyConfig) { k.codec = c } }

// NewKey returns the key of the entity type name, whose requests are Req
// and replies Rep.
func NewKey[Req, Rep any](name string, opts ...KeyOption) Key[Req, Rep] {
	cfg := keyConfig{codec: JSON}
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.codec == nil {
		cfg.codec = JSON
	}
	return Key[Req, Rep]{name: name, codec: cfg.codec}
}

// Name is the type's name.
func (k Key[Req, Rep]) Name() string { return k.name }

// Codec is the key's codec (JSON when the zero Key).
func (k Key[Req, Rep]) Codec() Codec {
	if k.codec == nil {
		return JSON
	}
	return k.codec
}

// Ref returns a typed reference to entity id of the type, sending with c.
// It checks nothing: a bad id fails its first call.
func (k Key[Req, Rep]) Ref(c *Client, id string) Ref[Req, Rep] {
	return Ref[Req, Rep]{ref: c.Entity(k.name, id), codec: k.Codec()}
}

// Details decodes into v the details of the error answer err (an
// *EntityError whose entity returned an Error WithDetails), and reports
// whether there were such details.
func (k Key[Req, Rep]) Details(err error, v any) bool {
	var ee *EntityError
	if !errors.As(err, &ee) || ee.Code == "" || len(ee.Data) == 0 {
		return false
	}
	return k.Codec().Unmarshal(ee.Data, v) == nil
}

// Ref is a typed reference to one entity (Akka typed's EntityRef): Ask
// and Tell encode the request with the key's codec, send it, and decode
// the reply. It is a value, cheap to make and safe for concurrent use.
type Ref[Req, Rep any] struct {
	ref   EntityRef
	codec Codec
}

// ID is the entity's id.
func (r Ref[Req, Rep]) ID() string { return r.ref.ID() }

// Type is the name of the entity's type.
func (r Ref[Req, Rep]) Type() string { return r.ref.Type() }

// Ask sends req to the entity and returns its decoded reply, with the
// guarantees of Client.Request (MsgID: applied once, however often it is
// sent, and answered with the first answer). An error the entity returned
// is an *EntityError, which errors.Is matches against the type's declared
// errors (NewError) by their code.
func (r Ref[Req, Rep]) Ask(ctx context.Context, req Req, opts ...SendOption) (Rep, error) {
	var rep Rep
	data, err := r.codec.Marshal(req)
	if err != nil {
		return rep, fmt.Errorf("natshard: encode a request to entity %s of type %s: %w", r.ref.ID(), r.ref.Type(), err)
	}
	answer, err := r.ref.Request(ctx, data, opts...)
	if err != nil {
		return rep, err
	}
	if err := r.codec.Unmarshal(answer, &rep); err != nil {
		return rep, fmt.Errorf("natshard: decode the answer of entity %s of type %s: %w", r.ref.ID(), r.ref.Type(), err)
	}
	return rep, nil
}

// Tell sends req to the entity without waiting for it (Client.Publish).
func (r Ref[Req, Rep]) Tell(ctx context.Context, req Req, opts ...SendOption) error {
	data, err := r.codec.Marshal(req)
	if err != nil {
		return fmt.Errorf("natshard: encode a message to entity %s of type %s: %w", r.ref.ID(), r.ref.Type(), err)
	}
	return r.ref.Publish(ctx, data, opts...)
}
