package send

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"
	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// ErrUnknownType: the type has no KV bucket on the NATS servers the client
// reaches: no node ever hosted it (or it was deleted).
var ErrUnknownType = errors.New("natshard: unknown entity type")

// DefaultTimeout bounds a Client's call whose context has no deadline.
const DefaultTimeout = 30 * time.Second

// keyedResend is how long a request with an idempotency key (MsgID)
// waits for its answer before it is sent again (core delivery), or its
// answer asked for (durable delivery), when WithResend set no other
// time: with a key, sending again never applies twice.
const keyedResend = 2 * time.Second

// ErrNoAnswer: a request sent again with the key of a message its
// entity applied already could not be answered as the first time: the
// entity keeps no answer for that key any more (it applied it before the
// window of answers it keeps: docs/PROTOCOL.md, "Idempotency keys"), or
// the message failed before its entity handled it. It was not applied
// again.
var ErrNoAnswer = errors.New("natshard: no answer kept for the idempotency key")

// attemptTimeout bounds one request to JetStream (reading a type's
// configuration, a publish to a stream), which is tried again while the
// call's context lasts.
const attemptTimeout = 5 * time.Second

// Client sends messages to entities of any type: it needs nothing but a
// NATS connection, and no process it talks to needs to know it. It learns
// each type's shard count from the type's KV bucket, and follows it: when
// the type is resharded (docs/PROTOCOL.md, Resharding), a watch of the
// type's configuration tells it the new count once every region serves it,
// and it sends by that count from then on (messages sent by the old count
// still reach their entities). The watch lasts as long as the connection.
// A type of durable delivery is the exception: a Client keeps the count it
// learnt first, so that its messages keep their order (their owners
// forward them to the children); a new Client learns the new count.
// It is safe for concurrent use. The
// requests of every Client of a connection, core and durable, wait for
// their answers on one subscription of the connection (a wildcard on a
// new inbox; nats.CustomInboxPrefix applies), made at the first request
// and ended when the connection closes, as nc.Request's is.
//
// Every message it sends has a key, unique unless MsgID gives one: while
// a shard moves, its messages may reach both the old and the new owner,
// and the new owner skips the copies by that key, so a message is handled
// once through planned moves (docs/PROTOCOL.md, "Handoff"). A publish
// carries its key in a Nats-Msg-Id header, marked unique (a leading "~":
// the client never sends it again in another call, so no entity keeps an
// answer for it); MsgID's key is an idempotency key instead, whose
// message is applied once and answered with the first answer however
// often it is sent (MsgID). A core request carries no header (unless MsgID,
// Header or a trace context give it one): its reply subject,
// <inbox>.~<token>, is unique and marked so (protocol.UniqueReplyMark),
// and is its key; it keeps it when it is sent again (after a refusal, or
// WithResend). A header would cost a map where it is made and where it
// is read, and nothing more would be learnt from it. When the context
// of a call holds an OpenTelemetry span (an entity's Handle context of a
// traced message does), the message carries it as W3C trace context
// (traceparent), unless a Header option gave one.
//
// A request is delayed, not failed, while its entity's shard has no
// owner for a moment (after a crash, before the coordinator parks the
// shard; during a coordinator failover): an answer of "no responders", or
// a region's refusal of a message it did not handle (the shard moved, or
// is moving and its buffer is full), is retried with backoff until the
// context ends. A request that reached an entity whose process then died
// is not answered: with MsgID (or WithResend) it is sent again.
//
// To a type of durable delivery, a message is published to the type's
// stream and the call returns once the stream acknowledged it (stored,
// replicated): it is then handled even if regions crash or a NATS server
// dies. A request carries its reply subject in the Natshard-Reply header (a
// stored message keeps no reply subject) and waits there for the entity's
// answer, which comes however late the shard's next owner handles it. A
// request with MsgID that the stream dropped as a duplicate of one stored
// before asks the entity for that one's answer (Natshard-Answer-Of).
type Client struct {
	nc      *nats.Conn
	js      jetstream.JetStream
	prefix  string
	timeout time.Duration
	resend  time.Duration

	// types is what the client learnt of each type: a map replaced (under
	// mu) when a type is learnt, read without a lock by every call.
	mu    sync.Mutex
	types atomic.Pointer[map[string]clientType]

	// ids makes the messages' default Nats-Msg-Id: "~", a NUID of the
	// client's, then a count (nuid.Next takes a lock shared by the
	// process at every call); the "~" marks it unique
	// (protocol.IdempotencyKey).
	idPrefix string
	ids      atomic.Uint64
}

type clientType struct {
	subjects protocol.Subjects
	// shards is the type's announced shard count, shared by the clients
	// of the connection and kept up to date by one watch (countOf); in
	// durable delivery the count the client learnt first (Learn).
	shards  *atomic.Int64
	durable bool // durable delivery: sent through the type's stream
}

// A ClientOption configures a Client.
type ClientOption func(*Client)

// WithPrefix sets the data-plane subject prefix of the types (default
// "shard"), as given to their nodes (Options.DataPrefix).
func WithPrefix(data string) ClientOption { return func(c *Client) { c.prefix = data } }

// WithTimeout bounds the calls whose context has no deadline (default
// DefaultTimeout).
func WithTimeout(d time.Duration) ClientOption { return func(c *Client) { c.timeout = d } }

// WithResend sends a core request again, with the same key (its reply
// subject, or MsgID's), when no answer came after d: a request
// delivered to a region that crashed before answering is then answered by
// the shard's next owner. Without MsgID, an entity may thus handle a
// request twice when its process crashed after handling it and before the
// answer left: use it for idempotent requests, or where that is
// acceptable. (During planned moves, a copy is skipped by its key.) With
// MsgID, a request is applied once however often it is sent, and is sent
// again after d, or after 2 s without WithResend; in durable delivery its
// answer is asked for again instead.
func WithResend(d time.Duration) ClientOption { return func(c *Client) { c.resend = d } }

// NewClient returns a client on nc. The connection stays the caller's.
func NewClient(nc *nats.Conn, opts ...ClientOption) *Client {
	c := &Client{nc: nc, prefix: protocol.DefaultDataPrefix, timeout: DefaultTimeout, idPrefix: protocol.UniqueReplyMark + nuid.Next() + "."}
	for _, o := range opts {
		o(c)
	}
	return c
}

// A SendOption configures one message.
type SendOption func(*nats.Msg)

// MsgID sets the message's idempotency key, in a Nats-Msg-Id header
// (not starting with "~", which marks the Client's own unique keys). A
// message or request sent again with the key of one its entity applied
// already is not applied again, and a request is answered with the first
// answer (the same data, or the same *EntityError), in both delivery
// modes, through moves of its shard and, for persistent entities that
// keep their answers (the kv kind), crashes of its owner: give the same
// key to a message sent again after a failure, by this process or
// another. A Request with a key sends itself again when no answer came
// (every 2 s, or WithResend's time), through "no responders" and
// refusals, until its context ends.
//
// The promise holds within a window: the region keeps the answers to an
// active entity's last 64 keyed messages, and the kv kind saves those to
// its last 32 keyed changes (2 KiB of answers) with its state. A key sent
// again after more keyed messages than that to its entity is handled as a
// new message (core delivery), or, within the stream's 2-minute duplicate
// window (durable delivery), fails with ErrNoAnswer. docs/PROTOCOL.md,
// "Idempotency keys", says why and how.
//
// Without MsgID the key is unique: a Nats-Msg-Id of the client's on a
// publish, the reply subject of a core request; it only tells a message
// from the copies a move makes of it.
func MsgID(key string) SendOption {
	return func(m *nats.Msg) { m.Header.Set(protocol.HeaderMsgID, key) }
}

// Header adds the headers h to the message (a W3C traceparent, say).
func Header(h nats.Header) SendOption {
	return func(m *nats.Msg) {
		for k, vs := range h {
			for _, v := range vs {
				m.Header.Add(k, v)
			}
		}
	}
}

// Request sends data to entity id of type typ and returns its answer. An
// error the entity returned comes back as an *EntityError. With MsgID,
// it may send the request several times (after no answer in 2 s, "no
// responders", a refusal), and the entity applies it once: every call
// with that key gets the first answer (see MsgID for the window, and
// ErrNoAnswer beyond it).
func (c *Client) Request(ctx context.Context, typ, id string, data []byte, opts ...SendOption) ([]byte, error) {
	until := c.deadline(ctx)
	t, m, err := c.message(ctx, until, typ, id, data, opts)
	if err != nil {
		return nil, err
	}
	if t.durable {
		c.keyed(m)
		ctx, cancel := within(ctx, until)
		defer cancel()
		return c.requestDurable(ctx, typ, id, m)
	}
	replies := repliesOf(c.nc) // the connection's, shared by its clients
	every := c.resendEvery(m)
	var b backoff
	var token uint64 // the reply subject's, the same for every attempt
	for {
		attempt, resend := until, false
		if every > 0 {
			if next := time.Now().Add(every); until.IsZero() || next.Before(until) {
				attempt, resend = next, true
			}
		}
		var reply *nats.Msg
		reply, token, err = replies.request(ctx, m, attempt, token)
		if done, data, err := answer(typ, id, reply, err); done {
			return data, err
		}
		switch {
		case err == nil:
			// Handled by no entity: the shard moved or is moving. Again.
			err = fmt.Errorf("refused (%s): %s", reply.Header.Get(protocol.HeaderRefused), reply.Header.Get(protocol.HeaderError))
		case errors.Is(err, nats.ErrNoResponders):
			// Nobody serves the shard this moment. Again.
		case errors.Is(err, errNoAnswer) && resend:
			continue // WithResend: no answer in time; send it again now
		case errors.Is(err, errNoAnswer):
			return nil, fmt.Errorf("natshard: request to entity %s of type %s: %w", id, typ, context.DeadlineExceeded)
		default:
			return nil, fmt.Errorf("natshard: request to entity %s of type %s: %w", id, typ, err)
		}
		if !b.wait(ctx, until) {
			return nil, fmt.Errorf("natshard: request to entity %s of type %s: %w (retried %d times, last: %v)", id, typ, ended(ctx), b.n, err)
		}
	}
}

// answer reads the answer to a request: done when it is final (the data
// or the entity's error, or a malformed refusal); not done for a refusal
// that a new attempt may get past (err then says which) or when no answer
// came (err).
func answer(typ, id string, reply *nats.Msg, err error) (done bool, data []byte, _ error) {
	switch {
	case err != nil:
		return false, nil, err
	case reply.Header.Get(protocol.HeaderError) == "":
		return true, reply.Data, nil
	case reply.Header.Get(protocol.HeaderRefused) == "":
		return true, reply.Data, &EntityError{Type: typ, ID: id, Code: reply.Header.Get(protocol.HeaderErrorCode), Message: reply.Header.Get(protocol.HeaderError), Data: reply.Data}
	case reply.Header.Get(protocol.HeaderRefused) == protocol.RefusedMalformed:
		return true, nil, fmt.Errorf("natshard: request to entity %s of type %s: refused: %s", id, typ, reply.Header.Get(protocol.HeaderError))
	case reply.Header.Get(protocol.HeaderRefused) == protocol.RefusedNoAnswer:
		return true, nil, fmt.Errorf("natshard: request to entity %s of type %s: %w: %s", id, typ, ErrNoAnswer, reply.Header.Get(protocol.HeaderError))
	}
	return false, nil, nil
}

// resendEvery is how long a request m waits for its answer before it is
// sent again: WithResend's time, or keyedResend for a request with an
// idempotency key; 0: never.
func (c *Client) resendEvery(m *nats.Msg) time.Duration {
	if c.resend > 0 {
		return c.resend
	}
	if protocol.IdempotencyKey(m.Header) != "" {
		return keyedResend
	}
	return 0
}

// requestDurable publishes a request to the type's stream, with its inbox
// in Natshard-Reply, and waits there for the answer.
//
// When the stream dropped it as a duplicate of a message with its
// idempotency key (MsgID) stored before, the entity is asked for that
// message's answer instead (askAnswer): the stored message answers the
// inbox of the call that sent it, not this one's. A request with a key
// asks again when no answer came in resendEvery (an answer lost with a
// connection).
func (c *Client) requestDurable(ctx context.Context, typ, id string, m *nats.Msg) ([]byte, error) {
	inbox, err := repliesOf(c.nc).open() // on the connection's subscription
	if err != nil {
		return nil, fmt.Errorf("natshard: request to entity %s of type %s: %w", id, typ, err)
	}
	defer inbox.close()
	m.Header.Set(protocol.HeaderReply, inbox.subject)
	key := protocol.IdempotencyKey(m.Header)
	duplicate, err := c.publishDurable(ctx, m)
	if err != nil {
		return nil, fmt.Errorf("natshard: request to entity %s of type %s: %w", id, typ, err)
	}
	if duplicate && key != "" {
		if err := c.askAnswer(ctx, m.Subject, key, inbox.subject); err != nil {
			return nil, fmt.Errorf("natshard: request to entity %s of type %s: stored before (key %q); asking for its answer: %w", id, typ, key, err)
		}
	}
	every := c.resendEvery(m)
	for {
		wctx, cancel := ctx, context.CancelFunc(func() {})
		if key != "" && every > 0 {
			wctx, cancel = context.WithTimeout(ctx, every)
		}
		reply, err := inbox.next(wctx)
		cancel()
		if err != nil && ctx.Err() == nil && wctx.Err() != nil {
			// No answer in time: ask for it (the request is stored, and
			// applied once whatever happens).
			if err := c.askAnswer(ctx, m.Subject, key, inbox.subject); err != nil {
				return nil, fmt.Errorf("natshard: request to entity %s of type %s: stored, not answered yet; asking for its answer: %w", id, typ, err)
			}
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("natshard: request to entity %s of type %s: stored, not answered yet: %w", id, typ, err)
		}
		if done, data, err := answer(typ, id, reply, nil); done {
			return data, err
		}
		// A refusal: the message stays in the stream for the shard's
		// next owner, whose answer comes here.
	}
}

// askAnswer publishes to the type's stream, on subject (the entity's),
// a request for the answer to the message with key
// (protocol.HeaderAnswerOf), to be answered on inbox. Stored after that
// message, it reaches the entity after it: the entity answers it with
// the answer it kept, as the first time.
func (c *Client) askAnswer(ctx context.Context, subject, key, inbox string) error {
	q := &nats.Msg{Subject: subject, Header: nats.Header{}}
	q.Header.Set(protocol.HeaderAnswerOf, key)
	q.Header.Set(protocol.HeaderReply, inbox)
	c.keyed(q)
	_, err := c.publishDurable(ctx, q)
	return err
}

// publishDurable publishes m to the type's stream and waits for the
// stream's acknowledgement, retrying while JetStream is unavailable (a
// leader election): the same Nats-Msg-Id stores it once. duplicate: the
// stream had a message with m's Nats-Msg-Id already (stored by an
// earlier attempt, or by an earlier call with the same MsgID). A refusal
// for lack of space (kvstate.ErrNoSpace: the stream at its max bytes, the
// store full) is returned at once, and so is a closed connection's
// nats.ErrConnectionClosed.
func (c *Client) publishDurable(ctx context.Context, m *nats.Msg) (duplicate bool, _ error) {
	if err := c.jetStream(); err != nil {
		return false, err
	}
	var b backoff
	for {
		actx, cancel := context.WithTimeout(ctx, attemptTimeout) // an acknowledgement lost: again, same id
		_, duplicate, err := kvstate.PublishOnce(actx, c.js, m)
		cancel()
		if err == nil {
			return duplicate, nil
		}
		if errors.Is(err, kvstate.ErrNoSpace) {
			// The stream is full (or the store): say so at once; the
			// caller decides whether to wait for its entities to catch up.
			return false, fmt.Errorf("not stored in the type's stream, which refused it for lack of space: %w", err)
		}
		if c.closedFor(err) {
			return false, fmt.Errorf("not stored in the type's stream: %w", nats.ErrConnectionClosed)
		}
		if !errors.Is(err, kvstate.ErrUnavailable) || ctx.Err() != nil || !b.wait(ctx, time.Time{}) {
			return false, fmt.Errorf("not stored in the type's stream: %w", err)
		}
	}
}

// Publish sends data to entity id of type typ without waiting for its
// entity: to a type of core delivery a core NATS publish, delivered at
// most once (see the guarantees in docs/PROTOCOL.md); to a type of
// durable delivery a publish to its stream, which returns once the stream
// acknowledged it. ctx bounds learning the type, and the acknowledgement.
func (c *Client) Publish(ctx context.Context, typ, id string, data []byte, opts ...SendOption) error {
	until := c.deadline(ctx)
	t, m, err := c.message(ctx, until, typ, id, data, opts)
	if err != nil {
		return err
	}
	c.keyed(m)
	if t.durable {
		ctx, cancel := within(ctx, until)
		defer cancel()
		if _, err := c.publishDurable(ctx, m); err != nil {
			return fmt.Errorf("natshard: publish to entity %s of type %s: %w", id, typ, err)
		}
		return nil
	}
	if err := c.nc.PublishMsg(m); err != nil {
		return fmt.Errorf("natshard: publish to entity %s of type %s: %w", id, typ, err)
	}
	return nil
}

// EntityRef is an entity of a type, to send to: Client.Entity.
type EntityRef struct {
	c       *Client
	typ, id string
}

// Entity returns a reference to entity id of type typ. It checks nothing:
// a bad id or type fails its first call.
func (c *Client) Entity(typ, id string) EntityRef { return EntityRef{c: c, typ: typ, id: id} }

// ID is the entity's id.
func (e EntityRef) ID() string { return e.id }

// Type is the name of the entity's type.
func (e EntityRef) Type() string { return e.typ }

// Request is Client.Request to the entity.
func (e EntityRef) Request(ctx context.Context, data []byte, opts ...SendOption) ([]byte, error) {
	return e.c.Request(ctx, e.typ, e.id, data, opts...)
}

// Publish is Client.Publish to the entity.
func (e EntityRef) Publish(ctx context.Context, data []byte, opts ...SendOption) error {
	return e.c.Publish(ctx, e.typ, e.id, data, opts...)
}

// message builds the message to entity id of typ; learning the type
// ends at until. It has a header only when opts or a trace context give
// it one: a core request needs none (its reply subject is its key), and
// a header costs a map where it is made and where it is read.
func (c *Client) message(ctx context.Context, until time.Time, typ, id string, data []byte, opts []SendOption) (clientType, *nats.Msg, error) {
	if err := protocol.ValidateEntityID(id); err != nil {
		return clientType{}, nil, fmt.Errorf("natshard: %w", err)
	}
	t, err := c.typeOf(ctx, until, typ)
	if err != nil {
		return t, nil, err
	}
	m := &nats.Msg{Subject: t.subjects.EntityOf(id, int(t.shards.Load())), Data: data}
	if len(opts) > 0 {
		m.Header = nats.Header{}
		for _, o := range opts {
			o(m)
		}
	}
	injectTrace(ctx, m)
	return t, m, nil
}

// keyed gives m a Nats-Msg-Id of the client's unless it has one (MsgID):
// what a publish, and a message of durable delivery, is told from its
// copies by.
func (c *Client) keyed(m *nats.Msg) {
	if m.Header.Get(protocol.HeaderMsgID) != "" {
		return
	}
	if m.Header == nil {
		m.Header = nats.Header{}
	}
	var n [13]byte
	m.Header.Set(protocol.HeaderMsgID, c.idPrefix+string(strconv.AppendUint(n[:0], c.ids.Add(1), 36)))
}

// typeOf returns what the client knows of typ, reading the type's shard
// count from its KV bucket the first time (retried while JetStream is
// unavailable, until ctx ends or until).
func (c *Client) typeOf(ctx context.Context, until time.Time, typ string) (clientType, error) {
	if types := c.types.Load(); types != nil {
		if t, ok := (*types)[typ]; ok {
			return t, nil
		}
	}
	var t clientType
	ctx, cancel := within(ctx, until)
	defer cancel()
	subjects, err := protocol.NewSubjects(c.prefix, "", typ)
	if err != nil {
		return t, fmt.Errorf("natshard: %w", err)
	}
	var b backoff
	for {
		var cfg protocol.TypeConfig
		err := c.jetStream()
		if err == nil {
			// Each attempt is bounded: an answer lost (a server lost, a
			// leader election) must not take the whole of ctx.
			actx, cancel := context.WithTimeout(ctx, attemptTimeout)
			var store *kvstate.Store
			store, err = kvstate.Bind(actx, c.js, typ, kvstate.Options{})
			if err == nil {
				cfg, err = store.Config(actx)
			}
			cancel()
		}
		switch {
		case err == nil:
			// The watch of the count starts before the first message
			// (core delivery; a durable type's count is kept: Learn).
			if cfg.DeliveryOf() != protocol.DeliveryDurable {
				follow(c.nc, c.js, typ, cfg.Shards)
			}
			return c.Learn(subjects, cfg.Shards, cfg.DeliveryOf()), nil
		case errors.Is(err, kvstate.ErrNotFound):
			return t, fmt.Errorf("%w %q: NATS has no bucket %s (does a node host it?)", ErrUnknownType, typ, kvstate.BucketName(typ))
		case c.closedFor(err):
			return t, fmt.Errorf("natshard: type %q: %w", typ, nats.ErrConnectionClosed)
		case !errors.Is(err, kvstate.ErrUnavailable):
			return t, fmt.Errorf("natshard: type %q: %w", typ, err)
		}
		if !b.wait(ctx, time.Time{}) {
			return t, fmt.Errorf("natshard: type %q: %w (last: %v)", typ, ctx.Err(), err)
		}
	}
}

func (c *Client) jetStream() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.js != nil {
		return nil
	}
	js, err := jetstream.New(c.nc)
	c.js = js
	return err
}

// Learn tells the client a type's subjects, shard count and delivery
// (protocol.DeliveryCore or DeliveryDurable), as a node that hosts the
// type knows them: the client then does not read them from the type's
// KV bucket. A program that only sends has no need of it.
func (c *Client) Learn(subjects protocol.Subjects, shards int, delivery string) clientType {
	t := clientType{durable: delivery == protocol.DeliveryDurable, subjects: subjects}
	if t.durable {
		// The count learnt first, kept for the client's life: after a
		// split the owners of the parent shards forward what comes on
		// their subjects to the children, in order, and a client that
		// switched to the new count could have its first messages on a
		// child's subject handled before its last ones on the parent's,
		// still waiting there (docs/PROTOCOL.md, Resharding).
		t.shards = new(atomic.Int64)
		t.shards.Store(int64(shards))
	} else {
		t.shards = countOf(c.nc, subjects.Type(), shards)
	}
	c.mu.Lock()
	types := map[string]clientType{}
	if old := c.types.Load(); old != nil {
		types = maps.Clone(*old)
	}
	types[subjects.Type()] = t
	c.types.Store(&types)
	c.mu.Unlock()
	return t
}

// deadline is when a call with ctx ends: ctx's deadline, or else the
// client's timeout from now (zero: never). A call waits for a core
// request's answer against that time, with a timer reused from call to
// call; only what waits on a context (learning a type, JetStream) gets a
// context bounded by it (within).
func (c *Client) deadline(ctx context.Context) time.Time {
	if d, ok := ctx.Deadline(); ok {
		return d
	}
	if c.timeout > 0 {
		return time.Now().Add(c.timeout)
	}
	return time.Time{}
}

// closedFor reports whether err, JetStream's unavailability to kvstate
// (which counts a closed connection as one, as it does a leader
// election), is the connection's being closed: unavailable for good,
// nothing to wait for.
func (c *Client) closedFor(err error) bool {
	return errors.Is(err, kvstate.ErrUnavailable) && c.nc.IsClosed()
}

// within is ctx, ended at until if it would end later.
func within(ctx context.Context, until time.Time) (context.Context, context.CancelFunc) {
	if d, ok := ctx.Deadline(); until.IsZero() || ok && !d.After(until) {
		return ctx, func() {}
	}
	return context.WithDeadline(ctx, until)
}

// ended is why a call with ctx and an end of its own ended: ctx's error,
// or the end (context.DeadlineExceeded).
func ended(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	return context.DeadlineExceeded
}

// backoff waits 10 ms, then twice as long each time, 500 ms at most.
type backoff struct{ n int }

// wait waits for the next backoff and reports whether the call goes on:
// false when ctx ended, or when until (if not zero) came first (it waits
// until then).
func (b *backoff) wait(ctx context.Context, until time.Time) bool {
	d := min(10*time.Millisecond<<min(b.n, 6), 500*time.Millisecond)
	b.n++
	if !until.IsZero() {
		if left := time.Until(until); left < d {
			wait.Sleep(ctx, left)
			return false
		}
	}
	return wait.Sleep(ctx, d)
}
