package kvstate_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// TestReplayTailLost: a replay's consumer delivers the end marker into a
// connection that dies before the replay reads it (the fault campaign,
// core seeds 9 and 13: a partitioned target, routes black-holed). The
// consumer acknowledges nothing (AckNone), so it never delivers the
// marker again, and no later message reveals the gap: the replay waited
// for ever, its consumer saying nothing was pending and the marker
// delivered. Now a consumer that brings nothing for a while is replaced
// from where the replay was, and the replay ends.
func TestReplayTailLost(t *testing.T) {
	srv := natstest.RunServer(t)
	url := natstest.URL(srv)
	subjects := protocol.MustSubjects("", "", "tail")
	js := natstest.JetStream(t, natstest.Connect(t, url))
	b, err := kvstate.OpenBuffer(testCtx(t), js, subjects, kvstate.BufferOptions{Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	stream, err := js.Stream(testCtx(t), kvstate.BufferStream(subjects.Type()))
	if err != nil {
		t.Fatal(err)
	}
	// One attempt per shard: the marker must reach a pull request that
	// the proxy holds, which a pull expiring at that instant can miss.
	for shard := range 5 {
		proxy := natstest.NewProxy(t, url[len("nats://"):])
		rjs := natstest.JetStream(t, natstest.Connect(t, proxy.URL()))
		rb, err := kvstate.OpenBuffer(testCtx(t), rjs, subjects, kvstate.BufferOptions{Timeout: 10 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		want := plain(subjects, shard, 20, "tail")
		for _, m := range want {
			b.Append(shard, m, noFailure(t))
		}
		if err := b.Flush(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		got := make(chan *nats.Msg, len(want)+1)
		done := make(chan error, 1)
		ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
		go func() {
			_, err := rb.Replay(ctx, shard, 1, func(_ uint64, m *nats.Msg) { got <- m })
			done <- err
		}()
		natstest.Eventually(t, 30*time.Second, "the 20 messages replayed", func() bool { return len(got) == len(want) })
		consumer := func() *jetstream.ConsumerInfo {
			for name := range stream.ConsumerNames(testCtx(t)).Name() {
				c, err := stream.Consumer(testCtx(t), name)
				if err != nil {
					return nil
				}
				info, err := c.Info(testCtx(t))
				if err != nil || info.Config.FilterSubject != subjects.BufferShard(shard) {
					continue
				}
				return info
			}
			return nil
		}
		natstest.Eventually(t, 10*time.Second, "a pull request waiting", func() bool {
			info := consumer()
			return info != nil && info.NumWaiting > 0
		})
		proxy.Freeze()
		seq := mark(t, b, shard, 1)
		intoVoid := false // the consumer delivered the marker (into the frozen proxy)
		for until := time.Now().Add(5 * time.Second); !intoVoid && time.Now().Before(until); time.Sleep(20 * time.Millisecond) {
			info := consumer()
			intoVoid = info != nil && info.Delivered.Stream >= seq
		}
		proxy.Cut(10 * time.Millisecond) // what the proxy held is lost
		proxy.Thaw()
		select {
		case err := <-done:
			cancel()
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(60 * time.Second):
			cancel()
			t.Fatalf("the replay did not end within 60 s after its marker was delivered into a lost connection (stream seq %d)", seq)
		}
		close(got)
		var replayed []*nats.Msg
		for m := range got {
			replayed = append(replayed, m)
		}
		sameMsgs(t, replayed, want)
		if intoVoid {
			t.Logf("shard %d: the marker (seq %d) was delivered into the lost connection; the replay ended all the same", shard, seq)
			return
		}
		t.Logf("shard %d: no pull request held the marker; again", shard)
	}
	t.Fatal("in 5 tries the marker never went into the lost connection: nothing was tested")
}
