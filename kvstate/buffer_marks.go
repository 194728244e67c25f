package kvstate

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/protocol"
)

// Mark flushes, then appends the end marker of handoff to shard's buffer
// (a message with protocol.HeaderMarker set to the id, no Nats-Msg-Id) and
// returns its sequence. Appending the same marker twice is harmless.
//
// Markers have their own subject (protocol.Subjects.BufferMarker), so
// they do not count against MaxPerShard: a full buffer still takes the
// marker that ends its handoff. Appends to shard made while Mark runs may
// be stored before or after the marker.
func (b *Buffer) Mark(ctx context.Context, shard int, handoff uint64) (uint64, error) {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	if err := b.Flush(ctx); err != nil {
		return 0, err
	}
	m := &nats.Msg{
		Subject: b.subjects.BufferMarker(shard),
		Header:  nats.Header{protocol.HeaderMarker: []string{strconv.FormatUint(handoff, 10)}},
	}
	ack, err := b.js.PublishMsg(ctx, m)
	if err != nil {
		return 0, fmt.Errorf("mark handoff %d in %s: %w", handoff, m.Subject, bufferErr(err))
	}
	return ack.Sequence, nil
}

// Fence writes a fence of handoff to shard's buffer and returns its
// sequence: every Replay of the shard skips the messages that the source of
// handoff appends (AppendFrom) after it, whenever they arrive; what it
// appended before the fence is replayed. The coordinator fences a handoff
// when it takes the shard from its source without the source's consent
// (the handoff timed out, or the source was found gone), before it appends
// anything of its own: a source that was frozen meanwhile and wakes up
// still believing it pauses the shard (a zombie) cannot place a message
// behind the coordinator's, whatever it does.
//
// Fences have their own subject (protocol.Subjects.BufferFence), which
// Purge leaves alone: a purge up to an end marker after the fence would
// otherwise remove it, and a zombie's append stored after that purge
// would be replayed by a later owner. They go with the stream's MaxAge (a
// day); a region frozen that long has lost its registration long before.
// Fencing twice is harmless.
func (b *Buffer) Fence(ctx context.Context, shard int, handoff uint64) (uint64, error) {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	m := &nats.Msg{
		Subject: b.subjects.BufferFence(shard),
		Header:  nats.Header{protocol.HeaderFence: []string{strconv.FormatUint(handoff, 10)}},
	}
	ack, err := b.js.PublishMsg(ctx, m)
	if err != nil {
		return 0, fmt.Errorf("fence handoff %d in %s: %w", handoff, m.Subject, bufferErr(err))
	}
	return ack.Sequence, nil
}

// Purge removes shard's buffered messages with sequence up to and
// including upTo.
//
// Markers up to upTo go too; fences stay (see Fence). Purge(shard, 0)
// removes nothing; Purge(shard, math.MaxUint64) everything but the fences.
// (The server's purge request takes a sequence to purge up to but not
// including, and one subject filter: the messages and the markers are
// purged by two requests, sent at once.)
func (b *Buffer) Purge(ctx context.Context, shard int, upTo uint64) error {
	if upTo == 0 {
		return nil
	}
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	markers := make(chan error, 1)
	go func() { markers <- b.purge(ctx, b.subjects.BufferMarker(shard), upTo) }()
	return errors.Join(b.purge(ctx, b.subjects.Buffer(shard), upTo), <-markers)
}

// PurgeMessages is Purge without the markers: one request. A replay that
// purges behind itself leaves the markers it passed (those of other
// handoffs, which every replay skips) to its purge at its own marker.
func (b *Buffer) PurgeMessages(ctx context.Context, shard int, upTo uint64) error {
	if upTo == 0 {
		return nil
	}
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.purge(ctx, b.subjects.Buffer(shard), upTo)
}

// purge removes the messages of subject with sequence up to and including
// upTo (all of them for math.MaxUint64).
func (b *Buffer) purge(ctx context.Context, subject string, upTo uint64) error {
	opts := []jetstream.StreamPurgeOpt{jetstream.WithPurgeSubject(subject)}
	if upTo < ^uint64(0) {
		opts = append(opts, jetstream.WithPurgeSequence(upTo+1))
	}
	if err := b.stream.Purge(ctx, opts...); err != nil {
		return translate(fmt.Errorf("purge %s up to %d: %w", subject, upTo, err), ErrConflict)
	}
	return nil
}

// Clear empties shard's buffer for the source of handoff as it pauses
// (PROTOCOL.md, Handoff: a live shard's buffer may hold copies of messages
// it handled), unless handoff is fenced: then it removes nothing and
// returns ErrFenced. The source was frozen past the handoff timeout and
// woke up to pause a shard the coordinator has taken from it (see Fence);
// its purge would remove what the coordinator diverted since, before the
// new owner replayed it.
//
// Handoff is fenced when the shard's last fence names it or a later
// handoff (the coordinator numbers a shard's handoffs in increasing
// order). Clear reads the stream's last sequence first, then the fence,
// and purges only up to that sequence: a fence written after the read of
// the fence comes after that sequence, and so does everything the
// coordinator diverts behind it.
func (b *Buffer) Clear(ctx context.Context, shard int, handoff uint64) error {
	ictx, cancel := b.ctx(ctx)
	info, err := b.stream.Info(ictx)
	cancel()
	if err != nil {
		return translate(fmt.Errorf("clear buffer of shard %d: %w", shard, err), ErrConflict)
	}
	last := info.State.LastSeq
	fence, err := b.lastFence(ctx, shard)
	if err != nil {
		return err
	}
	if fence >= handoff && fence != 0 {
		return fmt.Errorf("%w: handoff %d of shard %d is fenced (the shard's last fence names handoff %d): the coordinator took the shard from this source", ErrFenced, handoff, shard, fence)
	}
	return b.Purge(ctx, shard, last)
}

// lastFence is the handoff id that shard's last fence names; 0: none.
func (b *Buffer) lastFence(ctx context.Context, shard int) (uint64, error) {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	subject := b.subjects.BufferFence(shard)
	m, err := b.stream.GetLastMsgForSubject(ctx, subject)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, translate(fmt.Errorf("read fence %s: %w", subject, err), ErrConflict)
	}
	h, err := strconv.ParseUint(m.Header.Get(protocol.HeaderFence), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%w: fence %s at %d: %w", ErrMalformed, subject, m.Sequence, err)
	}
	return h, nil
}

// Len is the number of messages in shard's buffer, markers excluded: what
// counts against MaxPerShard.
func (b *Buffer) Len(ctx context.Context, shard int) (uint64, error) {
	subject := b.subjects.Buffer(shard)
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	info, err := b.stream.Info(ctx, jetstream.WithSubjectFilter(subject))
	if err != nil {
		return 0, translate(fmt.Errorf("length of %s: %w", subject, err), ErrConflict)
	}
	return info.State.Subjects[subject], nil
}
