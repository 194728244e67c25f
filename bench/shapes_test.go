package bench

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/internal/benchlab"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

var (
	shapesOnly    = flag.String("shapes.only", "", "BenchmarkDurableShapes: the shapes to run, comma-separated (empty: the default set)")
	shapesProfile = flag.String("shapes.profile", "", "BenchmarkDurableShapes: write a CPU profile of each shape's rounds to `PREFIX`.<case>.<shape>.prof")
	shapesRounds  = flag.Int("shapes.rounds", 3, "BenchmarkDurableShapes: rounds per shape")
	shapesN       = flag.Int("shapes.shards", protocol.DefaultShards, "BenchmarkDurableShapes: shards of the type")
)

// shapesDefault are the shapes BenchmarkDurableShapes runs without
// -shapes.only.
var shapesDefault = []string{"one", "one-ackall", "regions", "shards-file", "shards-memory"}

// BenchmarkDurableShapes measures raw JetStream (no natshard) in the
// consumer shapes that durable delivery could take, on one embedded
// server, for docs/PROTOCOL.md's choice of one ("The consumers' shape").
// Each shape has a work-queue stream configured as a type's message
// stream (file storage, 1 GiB with discard-new, a 2-minute duplicate
// window) on subjects <shape>.<shard>.<entity>, and the same two
// publishers (asynchronous, at most window messages published and not
// yet received); its readers count each message and acknowledge it at
// once:
//
//	one             one unfiltered pull consumer: the best shape
//	one-ackall      the same on a stream of interest retention (a work
//	                queue refuses AckAll), every 100th message
//	                acknowledged with AckAll
//	regions         a consumer per region (2), each filtered on the
//	                shards it owns (FilterSubjects), stored in memory
//	shards-file     a consumer per shard, file-stored, 1 000 acks
//	                pending and pulls of 256 at most
//	shards-memory   the same, stored in memory: natshard's shape
//	parts-K         K streams instead of one, stream i taking the
//	                subjects of the shards s ≡ i mod K, and a consumer
//	                per shard as shards-memory's in its shard's stream
//	                (K divides the shard count; not in the default set)
//
// -shapes.only picks the shapes (default: the first five),
// -shapes.shards the shard count (128), -shapes.rounds the rounds per
// shape (3), and -shapes.profile writes a CPU profile of each shape's
// rounds. The rounds take turns between the shapes; each reports the
// median of its rounds' CPU time per message (of the whole process:
// server, publishers, readers) and messages/s. Run with
//
//	go test -run '^$' -bench BenchmarkDurableShapes -benchtime 1x ./bench/ \
//		-args -shapes.only one,shards-memory,parts-16 -shapes.profile /tmp/shapes
func BenchmarkDurableShapes(b *testing.B) {
	for _, c := range []shapesCase{
		{entities: 1000, window: 20_000},
		{entities: 1000, window: 1000},
		{entities: 100_000, window: 20_000},
	} {
		b.Run(fmt.Sprintf("entities=%d/window=%d", c.entities, c.window), func(b *testing.B) {
			for range b.N {
				r := runShapes(b, c, *shapesRounds, 20_000)
				for _, s := range r {
					b.ReportMetric(s.cpuUS, s.name+"-cpu-us/msg")
					b.ReportMetric(s.rate, s.name+"-msgs/s")
				}
				b.Log(shapesTable(c, r))
				report("BenchmarkDurableShapes: " + shapesTable(c, r))
			}
		})
	}
}

type shapesCase struct {
	entities, window int
}

// shapeResult is one shape's medians over the rounds.
type shapeResult struct {
	name         string
	cpuUS, rate  float64
	cpus, rates  []float64
	consumers    int
	received     atomic.Int64
	target, done atomic.Int64 // done: since the round's start, in ns, when received reached target
	iters        []jetstream.MessagesContext
	pulls        sync.WaitGroup
	subjects     []string // of each entity
	streamName   string
}

func (s *shapeResult) add(start int64) int64 {
	n := s.received.Add(1)
	if n == s.target.Load() {
		s.done.Store(time.Now().UnixNano() - start)
	}
	return n
}

func shapesTable(c shapesCase, r []*shapeResult) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "%d entities, window %d:", c.entities, c.window)
	for _, s := range r {
		fmt.Fprintf(&sb, " %s %.1f us/msg %.0f msgs/s (%d consumers);", s.name, s.cpuUS, s.rate, s.consumers)
	}
	return sb.String()
}

const (
	shapesRegions = 2
)

// runShapes runs rounds rounds of msgs messages per shape.
func runShapes(tb testing.TB, c shapesCase, rounds, msgs int) []*shapeResult {
	srv := natstest.RunServer(tb)
	url := natstest.URL(srv)
	ctx := context.Background()
	admin := natstest.Connect(tb, url)
	js := natstest.JetStream(tb, admin)
	var start atomic.Int64
	names := shapesDefault
	if *shapesOnly != "" {
		names = strings.Split(*shapesOnly, ",")
	}
	var shapes []*shapeResult
	for _, n := range names {
		shapes = append(shapes, &shapeResult{name: n})
	}
	prof := benchlab.NewSideProfiles(*shapesProfile)
	shapesShards := *shapesN
	readers := make([]*nats.Conn, shapesRegions)
	for i := range readers {
		readers[i] = natstest.Connect(tb, url)
	}
	for _, s := range shapes {
		prefix := strings.ReplaceAll(s.name, "-", "_")
		s.streamName = "shapes_" + prefix
		retention := jetstream.WorkQueuePolicy
		if s.name == "one-ackall" {
			retention = jetstream.InterestPolicy // a work queue takes no AckAll
		}
		// parts-K: K streams, stream i taking the shards s ≡ i mod K.
		parts := 1
		if k, ok := strings.CutPrefix(s.name, "parts-"); ok {
			var err error
			if parts, err = strconv.Atoi(k); err != nil || parts < 1 || shapesShards%parts != 0 {
				tb.Fatalf("shape %s: K must divide %d", s.name, shapesShards)
			}
		}
		streamOf := func(shard int) string {
			if parts == 1 {
				return s.streamName
			}
			return s.streamName + "_" + strconv.Itoa(shard%parts)
		}
		for i := range parts {
			subjects := []string{prefix + ".>"}
			if parts > 1 {
				subjects = nil
				for n := i; n < shapesShards; n += parts {
					subjects = append(subjects, prefix+"."+strconv.Itoa(n)+".*")
				}
			}
			if _, err := js.CreateStream(ctx, jetstream.StreamConfig{
				Name: streamOf(i), Subjects: subjects, Retention: retention,
				Storage: jetstream.FileStorage, Duplicates: 2 * time.Minute, Discard: jetstream.DiscardNew, MaxBytes: 1 << 30,
				MaxConsumers: 1 << 20, // -1 takes the server's default of 1 000
			}); err != nil {
				tb.Fatal(err)
			}
		}
		for i := range c.entities {
			id := "e-" + strconv.Itoa(i)
			s.subjects = append(s.subjects, prefix+"."+strconv.Itoa(protocol.ShardOf(id, shapesShards))+"."+id)
		}
		shard := func(n int) string { return prefix + "." + strconv.Itoa(n) + ".*" }
		base := jetstream.ConsumerConfig{AckPolicy: jetstream.AckExplicitPolicy, AckWait: 5 * time.Minute}
		var configs []jetstream.ConsumerConfig
		var streams []string // of each config
		batch := 1000
		switch s.name {
		case "one", "one-ackall":
			cc := base
			cc.Durable, cc.MaxAckPending = "one", 20_000
			if s.name == "one-ackall" {
				cc.AckPolicy = jetstream.AckAllPolicy
			}
			configs = append(configs, cc)
		case "regions":
			for r := range shapesRegions {
				cc := base
				cc.Durable, cc.MaxAckPending, cc.MemoryStorage = "region-"+strconv.Itoa(r), 20_000, true
				for n := r; n < shapesShards; n += shapesRegions {
					cc.FilterSubjects = append(cc.FilterSubjects, shard(n))
				}
				configs = append(configs, cc)
			}
		case "shards-file", "shards-memory":
			batch = 256
			for n := range shapesShards {
				cc := base
				cc.Durable, cc.MaxAckPending, cc.FilterSubject = "shard-"+strconv.Itoa(n), 1000, shard(n)
				cc.MemoryStorage = s.name == "shards-memory"
				configs = append(configs, cc)
			}
		default:
			if parts == 1 {
				tb.Fatalf("no shape %q", s.name)
			}
			batch = 256
			for n := range shapesShards {
				cc := base
				cc.Durable, cc.MaxAckPending, cc.FilterSubject = "shard-"+strconv.Itoa(n), 1000, shard(n)
				cc.MemoryStorage = true
				configs = append(configs, cc)
			}
		}
		for range configs {
			streams = append(streams, s.streamName)
		}
		if parts > 1 {
			for n := range configs {
				streams[n] = streamOf(n)
			}
		}
		s.consumers = len(configs)
		for i, cc := range configs {
			rjs := natstest.JetStream(tb, readers[i%len(readers)])
			cons, err := rjs.CreateConsumer(ctx, streams[i], cc)
			if err != nil {
				tb.Fatal(err)
			}
			it, err := cons.Messages(jetstream.PullMaxMessages(batch))
			if err != nil {
				tb.Fatal(err)
			}
			s.iters = append(s.iters, it)
			s.pulls.Go(func() {
				for {
					m, err := it.Next()
					if errors.Is(err, jetstream.ErrMsgIteratorClosed) {
						return
					}
					if err != nil {
						continue
					}
					// AckAll: every 100th acknowledges those before it,
					// and the round's last its tail.
					if n := s.add(start.Load()); s.name != "one-ackall" || n%100 == 0 || n == s.target.Load() {
						_ = m.Ack()
					}
				}
			})
		}
	}
	tb.Cleanup(func() {
		for _, s := range shapes {
			for _, it := range s.iters {
				it.Stop()
			}
			s.pulls.Wait()
		}
	})
	pubs := make([]jetstream.JetStream, 2)
	for i := range pubs {
		var err error
		pubs[i], err = jetstream.New(natstest.Connect(tb, url), jetstream.WithPublishAsyncMaxPending(c.window/len(pubs)))
		if err != nil {
			tb.Fatal(err)
		}
	}
	for round := range rounds {
		for i := range shapes {
			s := shapes[(round+i)%len(shapes)]
			time.Sleep(300 * time.Millisecond) // the previous round's consumer state writes are not this one's
			s.received.Store(0)
			s.target.Store(int64(msgs))
			s.done.Store(0)
			if err := prof.Start(); err != nil {
				tb.Fatal(err)
			}
			cpu0 := benchlab.ProcessCPU()
			start.Store(time.Now().UnixNano())
			var wg sync.WaitGroup
			var sent atomic.Int64
			for p, pjs := range pubs {
				wg.Go(func() {
					for i := p; i < msgs; i += len(pubs) {
						for sent.Load()-s.received.Load() > int64(c.window) {
							time.Sleep(50 * time.Microsecond)
						}
						for {
							_, err := pjs.PublishAsync(s.subjects[i%len(s.subjects)], []byte("0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789012345678901234567"))
							if err == nil {
								break
							}
							if !errors.Is(err, jetstream.ErrTooManyStalledMsgs) {
								tb.Error(err)
								return
							}
						}
						sent.Add(1)
					}
					<-pjs.PublishAsyncComplete()
				})
			}
			wg.Wait()
			deadline := time.Now().Add(time.Minute)
			for s.done.Load() == 0 {
				if time.Now().After(deadline) {
					tb.Fatalf("%s: received %d of %d in a minute", s.name, s.received.Load(), msgs)
				}
				time.Sleep(time.Millisecond)
			}
			s.cpus = append(s.cpus, float64(benchlab.ProcessCPU()-cpu0)/1e3/float64(msgs))
			if err := prof.Stop(s.name); err != nil {
				tb.Fatal(err)
			}
			s.rates = append(s.rates, float64(msgs)/time.Duration(s.done.Load()).Seconds())
		}
	}
	for _, s := range shapes {
		s.cpuUS, s.rate = benchlab.Median(s.cpus), benchlab.Median(s.rates)
	}
	if err := prof.Write(fmt.Sprintf("e%d-w%d", c.entities, c.window)); err != nil {
		tb.Fatal(err)
	}
	return shapes
}
