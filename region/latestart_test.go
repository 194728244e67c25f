package region

import (
	"io"
	"log/slog"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// delivery is a pulled message as the region sees it: its stream and
// consumer sequences.
type delivery struct {
	jetstream.Msg
	stream, consumer uint64
}

func (d delivery) Metadata() (*jetstream.MsgMetadata, error) {
	return &jetstream.MsgMetadata{Sequence: jetstream.SequencePair{Stream: d.stream, Consumer: d.consumer}}, nil
}

// TestFirstDeliveryStartsLate (issue 30, the durable loss): a shard's new
// consumer whose first delivery comes after a message of the shard the
// stream's leader holds started late (its first leader chose its start
// from a copy of the stream that was behind) and is made again, so that
// the message is not left behind for an entity to skip later; one that
// starts at the shard's first message is taken, and so is a late one made
// again maxLateStarts times (a handled message whose removal was lost
// looks the same and would never come).
func TestFirstDeliveryStartsLate(t *testing.T) {
	nc := natstest.Connect(t, natstest.URL(natstest.RunServer(t)))
	js := natstest.JetStream(t, nc)
	subjects := protocol.MustSubjects("", "", "late")
	ctx := t.Context()
	stream, err := kvstate.OpenStream(ctx, js, subjects, kvstate.StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var seqs []uint64
	for range 3 {
		ack, err := js.PublishMsg(ctx, &nats.Msg{Subject: subjects.EntityOf("e-0", 4), Data: []byte("x")})
		if err != nil {
			t.Fatal(err)
		}
		seqs = append(seqs, ack.Sequence)
	}
	a := &Agent{cfg: Config{Stream: stream}, log: slog.New(slog.NewTextHandler(io.Discard, nil)), ctx: ctx}
	first := func(stream uint64) (*streamShard, bool) {
		ss := &streamShard{a: a, n: protocol.ShardOf("e-0", 4), mode: modeLive}
		return ss, ss.inOrder(delivery{stream: stream, consumer: 1})
	}
	if _, ok := first(seqs[0]); !ok {
		t.Fatalf("a consumer whose first delivery is the shard's first message (%d) refused", seqs[0])
	}
	ss, ok := first(seqs[1])
	if ok {
		t.Fatalf("a consumer whose first delivery (%d) is past the shard's first message (%d) taken", seqs[1], seqs[0])
	}
	for range maxLateStarts - 1 {
		ss.next = 0 // made again
		if ss.inOrder(delivery{stream: seqs[1], consumer: 1}) {
			t.Fatalf("a late consumer taken after %d tries; want %d", ss.lateStarts, maxLateStarts)
		}
	}
	ss.next = 0
	if !ss.inOrder(delivery{stream: seqs[1], consumer: 1}) {
		t.Fatalf("a consumer late %d times in a row still refused", maxLateStarts+1)
	}
	// Later deliveries are checked for gaps only.
	if !ss.inOrder(delivery{stream: seqs[2], consumer: 2}) || ss.inOrder(delivery{stream: seqs[2], consumer: 4}) {
		t.Fatal("the deliveries after the first are not checked by their consumer sequence")
	}
}
