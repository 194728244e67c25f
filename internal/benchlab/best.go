package benchlab

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// bestShape is raw JetStream in its best shape on the bench's server, the
// baseline of durable delivery's target (docs/BENCHMARKS.md): a stream
// configured as the type's message stream, the same publishers, and as
// few pull consumers as keep up (--best-consumers, 1 by default: an
// unfiltered consumer, which the server reads fastest; more split the
// type's shards among them by filter subjects), each on a connection of
// its own and read by one goroutine that counts every message and
// acknowledges it at once, without waiting for a confirmation. The acks
// are one per message: a work-queue stream takes no AckAll (nats-server
// refuses it, consumer.go: "workqueue stream requires explicit ack"), and
// AckFlowControl needs a push consumer with flow control.
type bestShape struct {
	stream string
	iters  []jetstream.MessagesContext
	pulls  sync.WaitGroup
}

// bestPrefix is the first token of the best-shape side's subjects.
const bestPrefix = "rawbest"

// The best shape's pulls: bigger batches than a region's, room for them
// in flight, and an AckWait as long as a shard consumer's (nothing is
// delivered twice in a run).
const (
	bestPullBatch     = 1000
	bestMaxAckPending = 20_000
	bestAckWait       = 5 * time.Minute
)

func (b *bench) bestShard(shard int) string {
	return bestPrefix + "." + b.sys.cfg.Type + "." + strconv.Itoa(shard) + ".>"
}

func (b *bench) bestEntity(shard int, id string) string {
	return bestPrefix + "." + b.sys.cfg.Type + "." + strconv.Itoa(shard) + "." + id
}

// openBest creates the best shape's stream (a copy of sc, the raw
// stream's configuration, on the best shape's subjects) and its
// consumers, and starts pulling.
func (b *bench) openBest(sc jetstream.StreamConfig) error {
	ctx, cancel := context.WithTimeout(b.ctx, b.cfg.Timeout)
	defer cancel()
	js := b.sys.js
	sc.Name = bestPrefix + "_" + b.sys.cfg.Type
	sc.Description = "shardctl bench: raw JetStream in its best shape beside type " + b.sys.cfg.Type
	sc.Subjects = []string{bestPrefix + "." + b.sys.cfg.Type + ".>"}
	if sc.MaxBytes > 0 {
		sc.MaxBytes *= int64(len(b.rawStreams)) // the room of the type's streams together
	}
	if _, err := js.Stream(ctx, sc.Name); err == nil {
		return fmt.Errorf("%w: stream %s exists on %s already; pass another --type", ErrUsage, sc.Name, b.sys.url)
	}
	if _, err := js.CreateStream(ctx, sc); err != nil {
		return fmt.Errorf("raw JetStream stream %s: %w", sc.Name, err)
	}
	b.best.stream = sc.Name
	n := b.cfg.BestConsumers
	for i := range n {
		cc := jetstream.ConsumerConfig{
			Durable:       "best-" + strconv.Itoa(i),
			Description:   "shardctl bench: raw JetStream in its best shape",
			AckPolicy:     jetstream.AckExplicitPolicy,
			AckWait:       bestAckWait,
			MaxAckPending: bestMaxAckPending,
			Replicas:      sc.Replicas,
		}
		if n > 1 {
			for shard := i; shard < b.cfg.Shards; shard += n {
				cc.FilterSubjects = append(cc.FilterSubjects, b.bestShard(shard))
			}
		}
		nc, err := b.sys.Connect("best-" + strconv.Itoa(i))
		if err != nil {
			return err
		}
		cjs, err := jetstream.New(nc)
		if err != nil {
			return err
		}
		cctx, cancel := context.WithTimeout(b.ctx, b.cfg.Timeout)
		cons, err := cjs.CreateConsumer(cctx, sc.Name, cc)
		cancel()
		if err != nil {
			return fmt.Errorf("raw JetStream consumer %s: %w", cc.Durable, err)
		}
		it, err := cons.Messages(jetstream.PullMaxMessages(bestPullBatch))
		if err != nil {
			return err
		}
		b.best.iters = append(b.best.iters, it)
		b.best.pulls.Go(func() { ackAll(it, b.bestRecv.add) })
	}
	return nil
}

// closeBest stops the best shape's pulls and deletes its stream.
func (b *bench) closeBest() {
	for _, it := range b.best.iters {
		it.Stop()
	}
	b.best.pulls.Wait()
	if b.best.stream != "" {
		ctx, cancel := context.WithTimeout(context.Background(), b.cfg.Timeout)
		_ = b.sys.js.DeleteStream(ctx, b.best.stream)
		cancel()
	}
}
