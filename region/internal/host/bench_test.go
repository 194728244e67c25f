package host

import (
	"context"
	"flag"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region/internal/host/hosttest"
)

// Benchmarks of the entity runtime, without NATS: dispatch of a message
// to its entity (Deliver: the cell, its mailbox, the worker that runs
// it), and what an idle entity costs in memory and to passivate
// (region's BenchmarkOnMessage times the whole subscription callback).
// Run with
//
//	go test -run '^$' -bench . -benchmem ./region/internal/host/
//	go test -run '^$' -bench BenchmarkIdleEntities -benchtime 1x ./region/internal/host/ -region.idle-entities=1000000

var flagIdleEntities = flag.Int("region.idle-entities", 100_000, "entities BenchmarkIdleEntities activates")

func benchFactory(context.Context, string) (Entity, error) { return hosttest.Entity[*Message]{}, nil }

// BenchmarkDeliver: messages delivered round-robin to entities, handled
// (one op is one message, until it is handled). With 1 entity the
// mailbox batches messages behind one goroutine; with 1000 nearly every
// message finds its entity idle and starts a goroutine. max-active=1000
// adds what the active-entity limit costs a message below the limit (the
// default policy's touch under its mutex).
func BenchmarkDeliver(b *testing.B) {
	for _, c := range []struct{ n, maxActive int }{{1, 0}, {1000, 0}, {1000, 1000}} {
		name := fmt.Sprintf("entities=%d", c.n)
		if c.maxActive > 0 {
			name += fmt.Sprintf("/max-active=%d", c.maxActive)
		}
		n := c.n
		b.Run(name, func(b *testing.B) {
			h := New(Config{Factory: benchFactory, Logger: discardLogger(), MaxActive: c.maxActive})
			ids, shards := hosttest.IDs(n)
			m := &nats.Msg{Subject: "x", Data: []byte("payload")}
			hosttest.Handled.Store(0)
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				h.Deliver(shards[i%n], ids[i%n], m)
			}
			hosttest.WaitHandled(b, int64(b.N))
		})
	}
}

// BenchmarkWake: one message at a time, each to an idle entity and
// handled before the next is delivered (one op is one message), as a
// request of a caller waiting for its answer: every message queues its
// cell with no worker searching, so a parked worker is woken for it and
// parks again after it (schedule, wake, park).
func BenchmarkWake(b *testing.B) {
	done := make(chan struct{})
	f := func(context.Context, string) (Entity, error) { return signalEntity(done), nil }
	h := New(Config{Factory: f, Logger: discardLogger()})
	ids, shards := hosttest.IDs(1000)
	m := &nats.Msg{Subject: "x", Data: []byte("payload")}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		h.Deliver(shards[i%len(ids)], ids[i%len(ids)], m)
		<-done
	}
}

// signalEntity sends on its channel for each message it handles.
type signalEntity chan struct{}

func (e signalEntity) Handle(context.Context, *Message) ([]byte, error) {
	e <- struct{}{}
	return nil, nil
}

func (signalEntity) Stop(context.Context) error { return nil }

// BenchmarkIdleEntities activates -region.idle-entities entities (one
// message each) in one host, and reports what each costs once idle
// (B/entity: live heap after a GC, the cell, its map entry and its id,
// divided by the count; goroutines/entity, which must be 0), then the
// time to passivate them all (passivate-ms, passivate-ns/entity: from
// the sweep that finds them idle until the last is removed). With
// max-active=n the region has an active-entity limit it does not reach:
// B/entity adds the policy's entry and its frequency sketch.
func BenchmarkIdleEntities(b *testing.B) {
	n := *flagIdleEntities
	for _, maxActive := range []int{0, n} {
		b.Run(fmt.Sprintf("max-active=%d", maxActive), func(b *testing.B) { benchIdleEntities(b, n, maxActive) })
	}
}

func benchIdleEntities(b *testing.B, n, maxActive int) {
	ids, shards := hosttest.IDs(n)
	m := &nats.Msg{Subject: "x", Data: []byte("payload")}
	for range b.N {
		clock := hosttest.NewClock()
		before := heapAfterGC()
		h := New(Config{Factory: benchFactory, Logger: discardLogger(), IdleTimeout: time.Minute, Now: clock.Now, MaxActive: maxActive})
		goroutines := runtime.NumGoroutine()
		hosttest.Handled.Store(0)
		for i := range n {
			h.Deliver(shards[i], ids[i], m)
		}
		hosttest.WaitHandled(b, int64(n))
		for !quiet(h) {
			time.Sleep(time.Millisecond)
		}
		// The workers that ran them park for idleKeep to twice that, then exit.
		for deadline := time.Now().Add(10 * idleKeep); runtime.NumGoroutine() > goroutines && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond)
		}
		after := heapAfterGC()
		b.ReportMetric(float64(after-before)/float64(n), "B/entity")
		b.ReportMetric(float64(runtime.NumGoroutine()-goroutines)/float64(n), "goroutines/entity")
		if got := h.Active(); got != n {
			b.Fatalf("%d entities active, want %d", got, n)
		}

		clock.Advance(2 * time.Minute)
		t0 := time.Now()
		if got := h.PassivateIdle(); got != n {
			b.Fatalf("passivation started for %d entities, want %d", got, n)
		}
		for h.Active() > 0 {
			time.Sleep(time.Millisecond)
		}
		d := time.Since(t0)
		b.ReportMetric(float64(d)/1e6, "passivate-ms")
		b.ReportMetric(float64(d)/float64(n), "passivate-ns/entity")
	}
}

// heapAfterGC returns the live heap after a full collection.
func heapAfterGC() int64 {
	var ms runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}

// BenchmarkTakeShards: a host takes 30 000 shards one after another (one
// op is all of them): what binding a region's shards costs the host, which
// must not grow with the shards it holds (TestHostShardCostFlat holds it
// by bytes).
func BenchmarkTakeShards(b *testing.B) {
	for b.Loop() {
		h := New(Config{Factory: benchFactory, Logger: discardLogger()})
		for n := range 30_000 {
			h.shardFor(n)
		}
	}
}

// BenchmarkDeliverKeyed is BenchmarkDeliver with 1000 entities for
// messages with a Nats-Msg-Id header: "unique", a key marked unique with
// "~" (natshard.Client's own on a publish: no answer kept); "keyed", an
// idempotency key of its own for every message (MsgID: the answer is
// kept in the entity's window, the oldest dropped).
func BenchmarkDeliverKeyed(b *testing.B) {
	for _, kind := range []string{"unique", "keyed"} {
		b.Run(kind, func(b *testing.B) {
			h := New(Config{Factory: benchFactory, Logger: discardLogger()})
			const n = 1000
			ids, shards := hosttest.IDs(n)
			msgs := make([]*nats.Msg, 4096)
			for i := range msgs {
				key := fmt.Sprintf("op-%d", i)
				if kind == "unique" {
					key = "~" + key
				}
				msgs[i] = &nats.Msg{Subject: "x", Data: []byte("payload"), Header: nats.Header{protocol.HeaderMsgID: {key}}}
			}
			hosttest.Handled.Store(0)
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				h.Deliver(shards[i%n], ids[i%n], msgs[i%len(msgs)])
			}
			hosttest.WaitHandled(b, int64(b.N))
		})
	}
}
