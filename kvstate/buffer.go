package kvstate

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/protocol"
)

// DefaultBufferPerShard bounds a shard's buffer (Akka's buffer-size).
const DefaultBufferPerShard = 100_000

// ErrBufferFull: the shard's buffer holds MaxPerShard messages; the message
// was not buffered.
var ErrBufferFull = errors.New("kvstate: shard buffer is full")

// Buffer stream settings.
const (
	// bufferDuplicates is the stream's de-duplication window: a message
	// whose Nats-Msg-Id the stream saw less than this long ago is
	// acknowledged as a duplicate and not stored again.
	bufferDuplicates = 2 * time.Minute
	// bufferMaxAge drops buffered messages nobody replayed (a handoff that
	// never completed) after a day.
	bufferMaxAge = 24 * time.Hour
	// bufferMaxPending is the number of Appends that may wait for their
	// acknowledgement at once, over all shards of a Buffer. Beyond it
	// Append waits for a free slot for at most bufferStallWait, then fails.
	bufferMaxPending = 1 << 16
	// bufferStallWait: see bufferMaxPending.
	bufferStallWait = 200 * time.Millisecond
	// bufferAckTimeout is how long an Append waits for its acknowledgement
	// (at least Timeout) before it fails with ErrUnavailable. It only
	// matters when the acknowledgement is lost (its server died, the
	// connection was closed); it must exceed by far the time the stream
	// takes to store a burst of pending Appends (seconds for tens of
	// thousands on R3), because a timed-out message may be stored anyway.
	bufferAckTimeout = 30 * time.Second
	// replayInactive is the inactive threshold of Replay's consumers: the
	// server deletes the consumer of a Replay that vanished (its process
	// died) after this long. A live Replay whose consumer was deleted
	// recreates it where it left off.
	replayInactive = time.Minute
	// replayBatch is the number of messages Replay's consumer keeps
	// buffered on the client.
	replayBatch = 1000
	// replayWatch: see BufferOptions.Logger.
	replayWatch = 5 * time.Second
)

// codeStoreFailed is the JetStream API error code with which the server
// refuses to store a message (JSStreamStoreFailedF in nats-server's
// errors.json, status 503). Its description is the reason; for a subject
// at its MaxMsgsPerSubject with DiscardNewPerSubject it is
// msgMaxPerSubject (nats-server's ErrMaxMsgsPerSubject), on a single
// server as on a cluster (checked before and after the raft proposal).
const codeStoreFailed jetstream.ErrorCode = 10077

const msgMaxPerSubject = "maximum messages per subject exceeded"

// codeDuplicateInProcess: a replicated stream (R>1) refuses a message whose
// Nats-Msg-Id is that of a message it has proposed to its raft group but
// not yet stored (JSStreamDuplicateMessageConflict, "duplicate message id
// is in process", status 409), where a single server would acknowledge a
// duplicate. Append takes it for the duplicate it is: should the first
// message fail after all, its own Append reports that.
const codeDuplicateInProcess jetstream.ErrorCode = 10158

// Header escaping. A buffered message must carry the original headers
// back unchanged, but the buffer stream is itself a JetStream stream that
// interprets (and strips) headers named Nats-...: an original
// Nats-Expected-Stream, Nats-Expected-Last-Sequence, Nats-Rollup (the
// stream allows no rollups, which would purge the shard's buffer) or
// Nats-TTL (no per-message TTLs) would make the server refuse the message,
// Nats-Expected-* and Nats-Batch-* are removed before storing, and headers
// that later servers learn to interpret could do anything. And an original
// header named like natshard's own (Natshard-Marker) must not pass for a
// marker at replay. So Append stores every header whose name starts with "Nats-"
// (except Nats-Msg-Id, which is kept on purpose for de-duplication) or
// "Natshard-" under escapePrefix+name, and Replay restores the name. Header
// names are case-sensitive, in nats.go as in the server.
const escapePrefix = "Natshard-Esc-"

func escapeHeader(name string) string {
	if name == protocol.HeaderMsgID {
		return name
	}
	if strings.HasPrefix(name, "Nats-") || strings.HasPrefix(name, "Natshard-") {
		return escapePrefix + name
	}
	return name
}

// noRetry makes an async publish fail at once on "no responders" (no
// stream leader) instead of publishing again later, which would store the
// message after those appended after it.
var noRetry = jetstream.WithRetryAttempts(0)

// BufferOptions configure OpenBuffer.
type BufferOptions struct {
	Replicas    int   // of the stream; 0 means 1
	MaxPerShard int64 // messages per shard; 0 means DefaultBufferPerShard
	// MaxBytes of the stream when it is created (a reservation in the
	// JetStream store, see space.go); 0 or less: no limit. An existing
	// stream keeps its own. With a limit, Append refuses messages
	// (ErrBufferFull and ErrNoSpace) once the stream reaches its reserve,
	// which is kept for end markers.
	MaxBytes int64
	Timeout  time.Duration // per operation when ctx has none; 0 means 5s
	// Shards of the type: a Replay has a consumer per shard, so an
	// existing stream that allows fewer is reported (Logger).
	Shards int
	// Logger, when set, gets a warning every replayWatch while a Replay
	// waits for its end marker, with what its consumer says.
	Logger *slog.Logger
}

// Buffer is the handoff buffer of one entity type: a JetStream stream
// (BufferStream(type)) whose subjects are the per-shard buffer subjects
// (protocol.Subjects.Buffer). A shard's source appends what arrives for the
// shard while it is paused or parked, then an end marker; the new owner
// replays the shard's buffer in order up to its marker. Safe for concurrent
// use; Append calls for one shard must come from one goroutine at a time to
// keep their order.
//
// A Buffer publishes through its own JetStream context on the connection
// of the JetStream given to OpenBuffer (same domain or API prefix), so
// that its asynchronous publishes, their limit and their acknowledgement
// handlers are its own.
type Buffer struct {
	js       jetstream.JetStream
	subjects protocol.Subjects
	opts     BufferOptions

	stream jetstream.Stream
	name   string // of the stream

	space    *budget // nil: the stream has no byte limit
	spaceLog *spaceLog

	mu       sync.Mutex
	pending  map[*nats.Msg]appendRec // buffered message -> its Append
	inflight int                     // Appends not yet acknowledged or failed
	// epochs counts the Appends in flight per Flush generation, oldest
	// first; the last one takes new Appends. Flush closes the open
	// generation (a new one takes later Appends) and waits until it and all
	// older ones are done, so that Appends made after Flush began never
	// delay it.
	epochs []*flushEpoch
}

// appendRec is one Append waiting for its acknowledgement.
type appendRec struct {
	orig    *nats.Msg
	failed  func(*nats.Msg, error)
	epoch   *flushEpoch
	counted int64 // the bytes the budget admitted for it (ended with it); 0: none
}

type flushEpoch struct {
	n    int           // Appends of this generation in flight
	done chan struct{} // closed when this and older generations are done; nil until a Flush waits
}

// BufferStream is the name of the buffer stream of type typ.
func BufferStream(typ string) string { return "natshard_buf_" + typ }

// OpenBuffer creates or binds the type's buffer stream: file storage,
// MaxMsgsPerSubject MaxPerShard with DiscardNew per subject (a full buffer
// refuses new messages instead of dropping old ones), duplicate window 2
// minutes (publishers' Nats-Msg-Id de-duplicate), MaxAge 24h, room for a
// replay consumer per shard (see consumerRoom).
//
// An existing stream is bound as it is, never updated (its replicas and
// limits win over opts); it must capture subjects.BufferAll(), otherwise
// OpenBuffer fails with ErrConfigMismatch.
func OpenBuffer(ctx context.Context, js jetstream.JetStream, subjects protocol.Subjects, opts BufferOptions) (*Buffer, error) {
	if js == nil {
		return nil, errors.New("kvstate: OpenBuffer with nil JetStream")
	}
	if subjects.Type() == "" {
		return nil, errors.New("kvstate: OpenBuffer with zero Subjects")
	}
	if opts.Replicas < 0 || opts.Replicas > 5 {
		return nil, fmt.Errorf("kvstate: %d replicas; use 1 to 5 (0 means 1)", opts.Replicas)
	}
	if opts.Replicas == 0 {
		opts.Replicas = 1
	}
	if opts.MaxPerShard < 0 {
		return nil, fmt.Errorf("kvstate: buffer of %d messages per shard", opts.MaxPerShard)
	}
	if opts.MaxPerShard == 0 {
		opts.MaxPerShard = DefaultBufferPerShard
	}
	if opts.Timeout <= 0 {
		opts.Timeout = defaultTimeout
	}
	b := &Buffer{
		subjects: subjects,
		opts:     opts,
		name:     BufferStream(subjects.Type()),
		pending:  make(map[*nats.Msg]appendRec),
		epochs:   []*flushEpoch{{}},
	}
	own, err := ownJetStream(js,
		jetstream.WithPublishAsyncMaxPending(bufferMaxPending),
		// An acknowledgement lost with its server, or a closed connection
		// (which, unlike a reconnection, does not fail pending publishes),
		// would otherwise keep Flush waiting forever.
		jetstream.WithPublishAsyncTimeout(max(opts.Timeout, bufferAckTimeout)),
		jetstream.WithPublishAsyncAckHandler(b.acked),
		jetstream.WithPublishAsyncErrHandler(b.refused),
	)
	if err != nil {
		return nil, err
	}
	b.js = own

	ctx, cancel := b.ctx(ctx)
	defer cancel()
	stream, err := createStream(ctx, own, jetstream.StreamConfig{
		Name:                 b.name,
		Description:          "natshard handoff buffer of type " + subjects.Type(),
		Subjects:             []string{subjects.BufferAll()},
		Storage:              jetstream.FileStorage,
		Replicas:             opts.Replicas,
		MaxMsgsPerSubject:    opts.MaxPerShard,
		Discard:              jetstream.DiscardNew,
		DiscardNewPerSubject: true,
		Duplicates:           bufferDuplicates,
		MaxAge:               bufferMaxAge,
		MaxBytes:             max(opts.MaxBytes, -1),
	})
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) || errors.Is(err, jetstream.ErrStreamNotFound) {
		stream, err = lookupStream(ctx, own, b.name)
		if err == nil && !slices.Contains(stream.CachedInfo().Config.Subjects, subjects.BufferAll()) {
			return nil, fmt.Errorf("%w: stream %s has subjects %q, not %q",
				ErrConfigMismatch, b.name, stream.CachedInfo().Config.Subjects, subjects.BufferAll())
		}
	}
	if err != nil {
		return nil, translate(fmt.Errorf("open buffer stream %s: %w", b.name, err), ErrConflict)
	}
	b.stream = stream
	info := stream.CachedInfo()
	warnConsumerRoom(ctx, own, opts.Logger, info, opts.Shards)
	b.spaceLog = newSpaceLog(opts.Logger, b.name, info.Config.MaxBytes)
	b.space = newBudget(b.name, info.Config.MaxBytes, int64(info.State.Bytes), "a moving shard's message",
		streamBytes(own, b.name))
	if b.space == nil && opts.Logger != nil {
		opts.Logger.Warn("the type's buffer stream has no byte limit: a full JetStream store would stop the type's leases (docs/OPERATIONS.md, Storage); set one with nats stream edit --max-bytes",
			"stream", b.name)
	}
	return b, nil
}

// ownJetStream is a new JetStream context on js's connection that talks to
// the same JetStream API (domain or prefix, default timeout, trace) as js.
func ownJetStream(js jetstream.JetStream, opts ...jetstream.JetStreamOpt) (jetstream.JetStream, error) {
	o := js.Options()
	if o.DefaultTimeout > 0 {
		opts = append(opts, jetstream.WithDefaultTimeout(o.DefaultTimeout))
	}
	if o.ClientTrace != nil {
		opts = append(opts, jetstream.WithClientTrace(o.ClientTrace))
	}
	switch {
	case o.Domain != "":
		return jetstream.NewWithDomain(js.Conn(), o.Domain, opts...)
	case o.APIPrefix != "":
		return jetstream.NewWithAPIPrefix(js.Conn(), o.APIPrefix, opts...)
	}
	return jetstream.New(js.Conn(), opts...)
}

// ctx bounds ctx by Timeout unless it has a deadline already.
func (b *Buffer) ctx(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, b.opts.Timeout)
}

// bufferErr translates an error of a publish to the buffer stream:
// ErrBufferFull when the shard's subject is at its limit, ErrUnavailable
// when the acknowledgement did not come in time or too many were pending,
// translate otherwise.
func bufferErr(err error) error {
	if err == nil {
		return nil
	}
	var api *jetstream.APIError
	if errors.As(err, &api) && api.ErrorCode == codeStoreFailed && strings.Contains(api.Description, msgMaxPerSubject) {
		return fmt.Errorf("%w: %w", ErrBufferFull, err)
	}
	if errors.Is(err, ErrNoSpace) {
		return fmt.Errorf("%w: %w", ErrBufferFull, err)
	}
	if cause := noSpaceCause(err); cause != "" {
		return fmt.Errorf("%w: %w: %s: %w", ErrBufferFull, ErrNoSpace, cause, err)
	}
	if errors.Is(err, jetstream.ErrAsyncPublishTimeout) || errors.Is(err, jetstream.ErrTooManyStalledMsgs) {
		return fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	return translate(err, ErrConflict)
}

// MaybeStored reports whether a message whose Append failed with err may
// be in the buffer all the same, and so be replayed and handled by the
// shard's next owner: its acknowledgement never came (bufferAckTimeout,
// the connection lost) or came as "no response from stream" (no
// responders while the stream's leader changed: the campaign found such
// messages replayed, issue 30). False for a refusal by the server (an
// API error: ErrBufferFull, no space, any other) and for a message that
// was never sent (too many pending, no space reserved, no subject, too
// large). A message that may be stored must not be refused to its
// requester: refused means not handled (PROTOCOL.md, Refusals); if it was
// stored, its buffered copy keeps the reply subject and is answered by
// the shard's next owner.
func MaybeStored(err error) bool {
	switch {
	case err == nil, errors.Is(err, ErrBufferFull), errors.Is(err, ErrNoSpace), apiCode(err) != 0,
		errors.Is(err, jetstream.ErrTooManyStalledMsgs), errors.Is(err, nats.ErrMaxPayload):
		return false
	}
	return errors.Is(err, jetstream.ErrAsyncPublishTimeout) || errors.Is(err, jetstream.ErrNoStreamResponse) ||
		errors.Is(err, nats.ErrTimeout) || errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, nats.ErrConnectionClosed) || errors.Is(err, nats.ErrConnectionReconnecting) ||
		errors.Is(err, nats.ErrDisconnected) || errors.Is(err, nats.ErrNoResponders)
}

// Append buffers m for shard without waiting for the server's
// acknowledgement, keeping the arrival order of Append calls. The buffered
// message keeps m's data and headers (Nats-Msg-Id included) and carries m's
// subject and reply subject in protocol.HeaderSubject and HeaderReply. If
// the server refuses it (ErrBufferFull, or another error), failed is called
// with m and the error, from another goroutine.
//
// Details. Headers that JetStream would interpret are stored escaped (see
// escapePrefix) and restored by Replay. A message whose Nats-Msg-Id the
// stream stored less than two minutes ago (on any shard, even if purged
// since), or is storing (codeDuplicateInProcess), is acknowledged as a
// duplicate and not stored again: that is a success, failed is not called.
// Other errors are ErrUnavailable (no stream leader; no acknowledgement
// within bufferAckTimeout, in which case the message may be stored after
// all; more than bufferMaxPending Appends waiting for theirs for longer
// than bufferStallWait), an error for a message without subject, or as
// translate leaves them. failed calls are not ordered among themselves;
// failed may be nil. Append blocks only while bufferMaxPending Appends are
// in flight, for at most bufferStallWait. m is neither modified nor kept,
// except to be passed to failed: its data is copied out before Append
// returns.
func (b *Buffer) Append(shard int, m *nats.Msg, failed func(m *nats.Msg, err error)) {
	b.append(shard, "", m, failed)
}

// AppendFrom is Append for the source region of a handoff, paused for
// handoff id handoff: the buffered message names it (protocol.HeaderSource),
// so that a Fence of that handoff stored before it makes every Replay skip
// it. The coordinator's own appends (a parked shard) use Append.
func (b *Buffer) AppendFrom(shard int, handoff uint64, m *nats.Msg, failed func(m *nats.Msg, err error)) {
	b.append(shard, strconv.FormatUint(handoff, 10), m, failed)
}

func (b *Buffer) append(shard int, source string, m *nats.Msg, failed func(m *nats.Msg, err error)) {
	bm := &nats.Msg{
		Subject: b.subjects.Buffer(shard),
		Data:    m.Data,
		Header:  make(nats.Header, len(m.Header)+3),
	}
	for k, v := range m.Header {
		bm.Header[escapeHeader(k)] = slices.Clone(v)
	}
	bm.Header[protocol.HeaderSubject] = []string{m.Subject}
	if m.Reply != "" {
		bm.Header[protocol.HeaderReply] = []string{m.Reply}
	}
	if source != "" {
		bm.Header[protocol.HeaderSource] = []string{source}
	}

	// Judged before it is registered, so that the record carries the
	// bytes the budget counted for it (ended with it: acked, refused).
	var (
		refusal error
		counted int64
	)
	if m.Subject == "" {
		refusal = errors.New("kvstate: append of a message without subject")
	} else {
		size := b.size(bm)
		if refusal = b.space.admit(context.Background(), size, false); refusal == nil {
			counted = size
		}
	}

	// Registered before publishing: the acknowledgement may arrive before
	// PublishMsgAsync returns.
	b.mu.Lock()
	ep := b.epochs[len(b.epochs)-1]
	ep.n++
	b.inflight++
	b.pending[bm] = appendRec{orig: m, failed: failed, epoch: ep, counted: counted}
	b.mu.Unlock()

	if refusal != nil {
		b.refused(nil, bm, refusal)
		return
	}
	if _, err := b.js.PublishMsgAsync(bm, noRetry, jetstream.WithStallWait(bufferStallWait)); err != nil {
		if errors.Is(err, nats.ErrMaxPayload) {
			err = fmt.Errorf("kvstate: a message of %d bytes does not fit the server's max_payload of %d bytes with the buffer's headers: %w",
				len(m.Data), b.js.Conn().MaxPayload(), err)
		}
		b.refused(nil, bm, err)
	}
}

// take removes bm's Append from the pending ones; false if it was done
// already (every Append ends exactly once).
func (b *Buffer) take(bm *nats.Msg) (appendRec, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	rec, ok := b.pending[bm]
	if ok {
		delete(b.pending, bm)
	}
	return rec, ok
}

// acked is the JetStream context's acknowledgement handler; it runs on
// the context's reply subscription and must not block.
func (b *Buffer) acked(_ jetstream.JetStream, bm *nats.Msg, _ *jetstream.PubAck) {
	if rec, ok := b.take(bm); ok {
		b.space.end(rec.counted)
		b.done(rec.epoch)
	}
}

// size is about what bm takes in the stream (space.go).
func (b *Buffer) size(bm *nats.Msg) int64 {
	if b.space == nil {
		return 0
	}
	hdr := 0
	for k, vs := range bm.Header {
		for _, v := range vs {
			hdr += len(k) + len(v) + 4
		}
	}
	return msgSize(bm.Subject, hdr, len(bm.Data))
}

// refused is the JetStream context's error handler, also called for
// publishes that fail at once. failed runs on its own goroutine, and the
// Append counts as done (for Flush) once failed returned.
func (b *Buffer) refused(_ jetstream.JetStream, bm *nats.Msg, err error) {
	if apiCode(err) == codeDuplicateInProcess {
		b.acked(nil, bm, nil)
		return
	}
	rec, ok := b.take(bm)
	if !ok {
		return
	}
	b.space.end(rec.counted) // stored or not: counted until the next read
	if rec.failed == nil {
		b.done(rec.epoch)
		return
	}
	err = bufferErr(err)
	b.spaceLog.noteIfNoSpace(err)
	go func() {
		defer b.done(rec.epoch)
		rec.failed(rec.orig, err)
	}()
}

// done ends an Append of generation ep and wakes the Flushes whose
// generations are all done.
func (b *Buffer) done(ep *flushEpoch) {
	b.mu.Lock()
	defer b.mu.Unlock()
	ep.n--
	b.inflight--
	for len(b.epochs) > 1 && b.epochs[0].n == 0 {
		if d := b.epochs[0].done; d != nil {
			close(d)
		}
		b.epochs[0] = nil
		b.epochs = b.epochs[1:]
	}
}

// Flush waits until every Append so far was acknowledged or failed.
//
// "Failed" includes the return of its failed callback. Appends made after
// Flush began do not delay it. Flush returns nil or ctx's error (as
// ErrUnavailable); failures are reported through failed only.
func (b *Buffer) Flush(ctx context.Context) error {
	b.mu.Lock()
	if b.inflight == 0 {
		b.mu.Unlock()
		return nil
	}
	ep := b.epochs[len(b.epochs)-1]
	if ep.done == nil {
		ep.done = make(chan struct{})
	}
	wait := ep.done
	b.epochs = append(b.epochs, &flushEpoch{})
	b.mu.Unlock()

	ctx, cancel := b.ctx(ctx)
	defer cancel()
	select {
	case <-wait:
		return nil
	case <-ctx.Done():
		return translate(fmt.Errorf("flush buffer %s: %w", b.name, ctx.Err()), ErrConflict)
	}
}
