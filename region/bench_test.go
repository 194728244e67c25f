package region

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region/internal/host"
	"github.com/natshard/natshard/region/internal/host/hosttest"
)

// Benchmarks of the region's hot path, without NATS: the whole
// subscription callback (Agent.onSubject: subject parsing, routing, the
// shard's mode, the hand-off to the entity runtime). internal/host's
// benchmarks time the runtime alone. Run with
//
//	go test -run '^$' -bench . -benchmem ./region/

func benchFactory(context.Context, string) (Entity, error) { return hosttest.Entity[*Message]{}, nil }

// BenchmarkOnMessage: the subscription callback of a live shard, from the
// NATS message to the entity's Handle (one op is one message, until it is
// handled), 1000 entities round-robin.
func BenchmarkOnMessage(b *testing.B) { benchOnMessage(b, false) }

// BenchmarkOnMessageStallWatch is BenchmarkOnMessage with the stall watch
// on (stall.go): each delivery and each Handle read the monotonic clock.
func BenchmarkOnMessageStallWatch(b *testing.B) { benchOnMessage(b, true) }

func benchOnMessage(b *testing.B, watch bool) {
	subjects := protocol.MustSubjects("", "", "bench")
	a := &Agent{cfg: Config{Subjects: subjects, Shards: protocol.DefaultShards, MaxHeld: 1}, log: slog.New(slog.DiscardHandler)}
	hc := host.Config{Factory: benchFactory, Logger: slog.New(slog.DiscardHandler)}
	if watch {
		a.clock.base, a.clock.limit = time.Now(), int64(DefaultStallLimit)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		a.wg.Add(1)
		go a.stallWatch(ctx)
		hc.Stalls = a.stallCount
	}
	a.host = host.New(hc)
	layout := protocol.MustLayout(protocol.DefaultShards)
	subs := make([]*subjectSub, protocol.DefaultShards)
	for i := range subs {
		st := &shardState{n: i, mode: modeLive}
		subs[i] = &subjectSub{token: i}
		subs[i].routes.Store(&routeSet{layout: layout, shards: map[int]*shardState{i: st}})
		st.subs = []*subjectSub{subs[i]}
	}
	ids, shards := hosttest.IDs(1000)
	msgs := make([]*nats.Msg, len(ids))
	for i, id := range ids {
		msgs[i] = &nats.Msg{Subject: subjects.Entity(shards[i], id), Data: []byte("payload")}
	}
	hosttest.Handled.Store(0)
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		j := i % len(msgs)
		a.onSubject(subs[shards[j]], msgs[j])
	}
	hosttest.WaitHandled(b, int64(b.N))
	if a.stats.Malformed.Load() != 0 {
		b.Fatal("malformed subjects")
	}
}
