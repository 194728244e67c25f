package region

import (
	"context"
	"log/slog"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region/internal/host"
)

// Benchmarks of the region's hot path, without NATS: the whole
// subscription callback (Agent.onSubject: subject parsing, routing, the
// shard's mode, the hand-off to the entity runtime). internal/host's
// benchmarks time the runtime alone. Run with
//
//	go test -run '^$' -bench . -benchmem ./region/

// benchHandled counts the messages benchEntity handled.
var benchHandled atomic.Int64

// benchEntity is as cheap as the echo entity: zero-size, no state.
type benchEntity struct{}

func (benchEntity) Handle(_ context.Context, m *Message) ([]byte, error) {
	benchHandled.Add(1)
	return m.Data, nil
}

func (benchEntity) Stop(context.Context) error { return nil }

func benchFactory(context.Context, string) (Entity, error) { return benchEntity{}, nil }

// waitHandled waits until benchHandled reaches n.
func waitHandled(b *testing.B, n int64) {
	deadline := time.Now().Add(time.Minute)
	for benchHandled.Load() < n {
		if time.Now().After(deadline) {
			b.Fatalf("handled %d of %d messages", benchHandled.Load(), n)
		}
		runtime.Gosched()
	}
}

// benchIDs returns n entity ids and their shards among DefaultShards.
func benchIDs(n int) ([]string, []int) {
	ids, shards := make([]string, n), make([]int, n)
	for i := range ids {
		ids[i] = "entity-" + strconv.Itoa(i)
		shards[i] = protocol.ShardOf(ids[i], protocol.DefaultShards)
	}
	return ids, shards
}

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
	ids, shards := benchIDs(1000)
	msgs := make([]*nats.Msg, len(ids))
	for i, id := range ids {
		msgs[i] = &nats.Msg{Subject: subjects.Entity(shards[i], id), Data: []byte("payload")}
	}
	benchHandled.Store(0)
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		j := i % len(msgs)
		a.onSubject(subs[shards[j]], msgs[j])
	}
	waitHandled(b, int64(b.N))
	if a.stats.Malformed.Load() != 0 {
		b.Fatal("malformed subjects")
	}
}
