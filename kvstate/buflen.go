package kvstate

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/protocol"
)

// BufferLengths reads how many messages each shard's buffer holds, end
// markers excluded (what Buffer.Len counts), from the buffer stream of
// subjects' type; shards with an empty buffer are left out. It is for
// tools: it binds the stream without creating it, and fails with
// ErrNotFound when the type has no buffer stream. When ctx has no
// deadline, the call is bounded by 5 s.
func BufferLengths(ctx context.Context, js jetstream.JetStream, subjects protocol.Subjects) (map[int]uint64, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, defaultTimeout)
		defer cancel()
	}
	name := BufferStream(subjects.Type())
	stream, err := js.Stream(ctx, name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, fmt.Errorf("%w: buffer stream %s: %w", ErrNotFound, name, err)
	}
	if err != nil {
		return nil, translate(fmt.Errorf("bind buffer stream %s: %w", name, err), ErrConflict)
	}
	// Buffer(n) is <prefix><n>.m
	prefix := strings.TrimSuffix(subjects.Buffer(0), "0.m")
	info, err := stream.Info(ctx, jetstream.WithSubjectFilter(prefix+"*.m"))
	if err != nil {
		return nil, translate(fmt.Errorf("buffer lengths of %s: %w", name, err), ErrConflict)
	}
	out := make(map[int]uint64, len(info.State.Subjects))
	for subj, n := range info.State.Subjects {
		tok := strings.TrimSuffix(strings.TrimPrefix(subj, prefix), ".m")
		if sh, err := strconv.Atoi(tok); err == nil && n > 0 {
			out[sh] = n
		}
	}
	return out, nil
}
