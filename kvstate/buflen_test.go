package kvstate_test

import (
	"errors"
	"maps"
	"testing"
	"time"

	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

func TestBufferLengths(t *testing.T) {
	js := natstest.JetStream(t, natstest.Connect(t, natstest.URL(natstest.RunServer(t))))
	ctx := testCtx(t)
	subjects := protocol.MustSubjects("", "app.ctl", "orders")
	if _, err := kvstate.BufferLengths(ctx, js, subjects); !errors.Is(err, kvstate.ErrNotFound) {
		t.Fatalf("BufferLengths without a stream: %v, want ErrNotFound", err)
	}
	b, err := kvstate.OpenBuffer(ctx, js, subjects, kvstate.BufferOptions{Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := kvstate.BufferLengths(ctx, js, subjects); err != nil || len(got) != 0 {
		t.Fatalf("empty buffer: %v, %v", got, err)
	}
	for _, m := range plain(subjects, 2, 3, "a") {
		b.Append(2, m, noFailure(t))
	}
	for _, m := range plain(subjects, 17, 1, "b") {
		b.Append(17, m, noFailure(t))
	}
	if err := b.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	mark(t, b, 2, 9)  // markers do not count
	mark(t, b, 40, 9) // nor does a shard with only a marker
	got, err := kvstate.BufferLengths(ctx, js, subjects)
	if want := map[int]uint64{2: 3, 17: 1}; err != nil || !maps.Equal(got, want) {
		t.Fatalf("BufferLengths = %v, %v; want %v", got, err, want)
	}
}
