package kvstate

import (
	"context"
	"errors"
	"time"

	"github.com/natshard/natshard/protocol"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// DefaultBufferPerShard bounds a shard's buffer (Akka's buffer-size).
const DefaultBufferPerShard = 100_000

// ErrBufferFull: the shard's buffer holds MaxPerShard messages; the message
// was not buffered.
var ErrBufferFull = errors.New("kvstate: shard buffer is full")

var errTODO = errors.New("kvstate: buffer not implemented yet")

// BufferOptions configure OpenBuffer.
type BufferOptions struct {
	Replicas    int           // of the stream; 0 means 1
	MaxPerShard int64         // messages per shard; 0 means DefaultBufferPerShard
	Timeout     time.Duration // per operation when ctx has none; 0 means 5s
}

// Buffer is the handoff buffer of one entity type: a JetStream stream
// (BufferStream(type)) whose subjects are the per-shard buffer subjects
// (protocol.Subjects.Buffer). A shard's source appends what arrives for the
// shard while it is paused or parked, then an end marker; the new owner
// replays the shard's buffer in order up to its marker. Safe for concurrent
// use; Append calls for one shard must come from one goroutine at a time to
// keep their order.
type Buffer struct {
	js       jetstream.JetStream
	subjects protocol.Subjects
	opts     BufferOptions
}

// BufferStream is the name of the buffer stream of type typ.
func BufferStream(typ string) string { return "natshard_buf_" + typ }

// OpenBuffer creates or binds the type's buffer stream: file storage,
// MaxMsgsPerSubject MaxPerShard with DiscardNew per subject (a full buffer
// refuses new messages instead of dropping old ones), duplicate window 2
// minutes (publishers' Nats-Msg-Id de-duplicate), MaxAge 24h.
func OpenBuffer(ctx context.Context, js jetstream.JetStream, subjects protocol.Subjects, opts BufferOptions) (*Buffer, error) {
	return nil, errTODO
}

// Append buffers m for shard without waiting for the server's
// acknowledgement, keeping the arrival order of Append calls. The buffered
// message keeps m's data and headers (Nats-Msg-Id included) and carries m's
// subject and reply subject in protocol.HeaderSubject and HeaderReply. If
// the server refuses it (ErrBufferFull, or another error), failed is called
// with m and the error, from another goroutine.
func (b *Buffer) Append(shard int, m *nats.Msg, failed func(m *nats.Msg, err error)) {
}

// Flush waits until every Append so far was acknowledged or failed.
func (b *Buffer) Flush(ctx context.Context) error { return errTODO }

// Mark flushes, then appends the end marker of handoff to shard's buffer
// (a message with protocol.HeaderMarker set to the id, no Nats-Msg-Id) and
// returns its sequence. Appending the same marker twice is harmless.
func (b *Buffer) Mark(ctx context.Context, shard int, handoff uint64) (uint64, error) {
	return 0, errTODO
}

// Replay reads shard's buffer in order from its first message and calls fn
// with each buffered message as it was published (Subject, Reply, Header
// and Data restored; the buffer's own headers removed), skipping end
// markers of other handoffs, until the end marker of handoff; it waits for
// more messages until then. It returns the marker's sequence, or ctx's
// error. fn runs on Replay's goroutine, one message at a time.
func (b *Buffer) Replay(ctx context.Context, shard int, handoff uint64, fn func(m *nats.Msg)) (uint64, error) {
	return 0, errTODO
}

// Purge removes shard's buffered messages with sequence up to and
// including upTo.
func (b *Buffer) Purge(ctx context.Context, shard int, upTo uint64) error { return errTODO }

// Len is the number of messages in shard's buffer.
func (b *Buffer) Len(ctx context.Context, shard int) (uint64, error) { return 0, errTODO }
