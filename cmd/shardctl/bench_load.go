package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// recvCounter counts messages at the receiving side and notes when the
// count reaches its target.
type recvCounter struct {
	n      atomic.Int64
	target atomic.Int64
	end    atomic.Int64 // since0() when n reached target
	done   atomic.Pointer[chan struct{}]
}

func (c *recvCounter) add() {
	if c.n.Add(1) == c.target.Load() {
		c.end.Store(since0())
		close(*c.done.Load())
	}
}

// reset starts counting from zero towards target (0: no target); the
// channel is closed when it is reached.
func (c *recvCounter) reset(target int64) <-chan struct{} {
	ch := make(chan struct{})
	c.target.Store(-1)
	c.n.Store(0)
	c.done.Store(&ch)
	if target > 0 {
		c.target.Store(target)
	}
	return ch
}

// bench runs the workloads of shardctl bench on a system.
type bench struct {
	ctx   context.Context
	cfg   benchConfig
	sys   *benchSystem
	prog  *progress
	sides *sideProfiles // --side-profiles (nil: none)

	pubs      []*nats.Conn // publishers, for both sides
	requester *nats.Conn   // latency and handoff requests, for both sides
	raw       recvCounter  // what the raw subscribers (or consumers) received
	ids       []string     // entity ids
	natSubj   []string     // natshard subject of each entity
	rawSubj   []string     // raw subject of each entity: same depth, another prefix
	payload   []byte       // throughput payload
	reqBody   []byte       // latency request

	// Durable delivery only: the publishers' JetStream contexts (at most
	// ackWindow publishes each waiting for their acknowledgement) and the
	// requester's; what they had acknowledged and what failed.
	pubJS   []jetstream.JetStream
	reqJS   jetstream.JetStream
	acked   atomic.Int64
	pubErrs atomic.Int64
	lastErr atomic.Pointer[error] // the last publish that failed
	// raw JetStream: its stream (a copy of the type's message stream's
	// configuration), deleted by close, and one pull consumer per shard
	// (a copy of the type's), each read by a goroutine of rawPulls.
	rawStream jetstream.StreamConfig
	rawIters  []jetstream.MessagesContext
	rawPulls  sync.WaitGroup
	// raw JetStream in its best shape (bench_best.go): what its
	// consumers received, and the subject of each entity there.
	best     bestShape
	bestRecv recvCounter
	bestSubj []string
}

// rawPrefix is the first token of the raw NATS side's subjects.
const rawPrefix = "rawbench"

// rawPullBatch is what each raw consumer's iterator keeps buffered: as a
// region's (region.pullBatch).
const rawPullBatch = 256

// newBench opens the publishers and the raw side: one subscriber
// connection per region, each subscribed to the same shards (raw
// subjects) as its region; with durable delivery, each pulling from a
// consumer per shard on a stream of raw subjects.
func newBench(ctx context.Context, sys *benchSystem, prog *progress) (*bench, error) {
	b := &bench{ctx: ctx, cfg: sys.cfg, sys: sys, prog: prog}
	b.cfg.Msgs = b.cfg.msgsFor(sys.delivery)
	if err := b.open(); err != nil {
		b.close()
		return nil, err
	}
	return b, nil
}

func (b *bench) durable() bool { return b.sys.delivery == natshard.Durable }

func (b *bench) open() error {
	cfg, sys := b.cfg, b.sys
	b.raw.reset(0)
	b.bestRecv.reset(0)
	sys.handled.reset(0)
	for i := range cfg.Pubs {
		nc, err := sys.connect("pub-" + strconv.Itoa(i))
		if err != nil {
			return err
		}
		b.pubs = append(b.pubs, nc)
		if b.durable() {
			js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(b.ackWindow()),
				jetstream.WithPublishAsyncAckHandler(func(jetstream.JetStream, *nats.Msg, *jetstream.PubAck) { b.acked.Add(1) }),
				jetstream.WithPublishAsyncErrHandler(func(_ jetstream.JetStream, _ *nats.Msg, err error) {
					b.pubErrs.Add(1)
					b.lastErr.Store(&err)
				}))
			if err != nil {
				return err
			}
			b.pubJS = append(b.pubJS, js)
		}
	}
	var err error
	if b.requester, err = sys.connect("requester"); err != nil {
		return err
	}
	var consumer jetstream.ConsumerConfig
	if b.durable() {
		if b.reqJS, err = jetstream.New(b.requester); err != nil {
			return err
		}
		if consumer, err = b.openRawStream(); err != nil {
			return err
		}
		if err := b.openBest(b.rawStream); err != nil {
			return err
		}
	}
	st, err := sys.status()
	if err != nil {
		return fmt.Errorf("coordinator status: %w", err)
	}
	own := owners(st)
	for _, id := range sys.regionIDs() {
		nc, err := sys.connect("raw-" + id)
		if err != nil {
			return err
		}
		if b.durable() {
			if err := b.pullRaw(nc, consumer, own[id]); err != nil {
				return err
			}
			continue
		}
		for _, shard := range own[id] {
			sub, err := nc.Subscribe(b.rawShard(shard), b.onRaw)
			if err != nil {
				return err
			}
			_ = sub.SetPendingLimits(-1, -1) // as a region's shard subscriptions
		}
		if err := nc.Flush(); err != nil {
			return err
		}
	}
	for i := range cfg.Entities {
		id := "e-" + strconv.Itoa(i)
		shard := protocol.ShardOf(id, cfg.Shards)
		b.ids = append(b.ids, id)
		b.natSubj = append(b.natSubj, sys.subjects.Entity(shard, id))
		b.rawSubj = append(b.rawSubj, b.rawEntity(shard, id))
		b.bestSubj = append(b.bestSubj, b.bestEntity(shard, id))
	}
	b.payload = make([]byte, cfg.Size)
	for i := range b.payload {
		b.payload[i] = 'a' + byte(i%26)
	}
	b.reqBody = b.payload
	if cfg.Kind == "kv" {
		b.payload = fmt.Appendf(nil, `{"op":"set","key":"v","value":"%s"}`, strings.Repeat("x", cfg.Size-minKVSize))
		b.reqBody = []byte(`{"op":"get","key":"v"}`)
	}
	return nil
}

// ackWindow is how many publishes each publisher may have waiting for
// their acknowledgement: the --window shared among the publishers.
func (b *bench) ackWindow() int {
	return (b.cfg.Window + b.cfg.Pubs - 1) / b.cfg.Pubs
}

// openRawStream creates raw JetStream's stream, a copy of the
// configuration of the type's message stream on the raw subjects
// (without the type's source of fired reminders, which is idle in the
// bench), and returns the configuration of the type's shard consumers
// (read from one of them) for the raw ones.
func (b *bench) openRawStream() (jetstream.ConsumerConfig, error) {
	ctx, cancel := context.WithTimeout(b.ctx, b.cfg.Timeout)
	defer cancel()
	js := b.sys.js
	nat, err := js.Stream(ctx, kvstate.MessageStream(b.sys.typ))
	if err != nil {
		return jetstream.ConsumerConfig{}, fmt.Errorf("the message stream of type %s: %w", b.sys.typ, err)
	}
	// Every shard has its consumer once the system settled; their names
	// are the protocol's (docs/PROTOCOL.md, "Durable delivery").
	consumer, err := nat.Consumer(ctx, shardConsumer(0))
	if err != nil {
		return jetstream.ConsumerConfig{}, fmt.Errorf("the consumer of shard 0 of type %s: %w", b.sys.typ, err)
	}
	sc := nat.CachedInfo().Config
	sc.Name = rawPrefix + "_" + b.sys.typ
	sc.Description = "shardctl bench: raw JetStream beside type " + b.sys.typ
	sc.Subjects = []string{rawPrefix + "." + b.sys.typ + ".>"}
	sc.Sources = nil
	if _, err := js.Stream(ctx, sc.Name); err == nil {
		return jetstream.ConsumerConfig{}, fmt.Errorf("%w: stream %s exists on %s already; pass another --type", errUsage, sc.Name, b.sys.url)
	}
	if _, err := js.CreateStream(ctx, sc); err != nil {
		return jetstream.ConsumerConfig{}, fmt.Errorf("raw JetStream stream %s: %w", sc.Name, err)
	}
	b.rawStream = sc
	return consumer.CachedInfo().Config, nil
}

// shardConsumer is the name of the consumer of shard n of a type's
// message stream, and of raw JetStream's.
func shardConsumer(n int) string { return "shard-" + strconv.Itoa(n) }

// pullRaw creates raw JetStream's consumers of shards on nc, configured
// as the type's (cfg) but for the raw subjects, and reads each in a
// goroutine of its own as a region reads its shards': pull, count, ack.
func (b *bench) pullRaw(nc *nats.Conn, cfg jetstream.ConsumerConfig, shards []int) error {
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	for _, shard := range shards {
		cc := cfg
		cc.Name, cc.Durable = "", shardConsumer(shard)
		cc.Description = "shardctl bench: raw JetStream, shard " + strconv.Itoa(shard)
		cc.FilterSubject, cc.FilterSubjects = b.rawShard(shard), nil
		ctx, cancel := context.WithTimeout(b.ctx, b.cfg.Timeout)
		cons, err := js.CreateConsumer(ctx, b.rawStream.Name, cc)
		cancel()
		if err != nil {
			return fmt.Errorf("raw JetStream consumer of shard %d: %w", shard, err)
		}
		it, err := cons.Messages(jetstream.PullMaxMessages(rawPullBatch))
		if err != nil {
			return err
		}
		b.rawIters = append(b.rawIters, it)
		b.rawPulls.Go(func() { ackAll(it, b.raw.add) })
	}
	return nil
}

// ackAll pulls it until it is closed or its consumer is gone, counting
// each message with add and acknowledging it (the raw sides' consumers).
func ackAll(it jetstream.MessagesContext, add func()) {
	for {
		m, err := it.Next()
		switch {
		case errors.Is(err, jetstream.ErrMsgIteratorClosed), errors.Is(err, jetstream.ErrConsumerDeleted), errors.Is(err, jetstream.ErrConsumerNotFound):
			return
		case err != nil:
			continue
		}
		add()
		_ = m.Ack()
	}
}

// close stops raw JetStream's consumers and deletes its stream. The
// connections are the system's.
func (b *bench) close() {
	b.closeBest()
	for _, it := range b.rawIters {
		it.Stop()
	}
	b.rawPulls.Wait()
	if b.rawStream.Name != "" {
		ctx, cancel := context.WithTimeout(context.Background(), b.cfg.Timeout)
		_ = b.sys.js.DeleteStream(ctx, b.rawStream.Name)
		cancel()
	}
}

func (b *bench) rawShard(shard int) string {
	return rawPrefix + "." + b.sys.typ + "." + strconv.Itoa(shard) + ".>"
}

func (b *bench) rawEntity(shard int, id string) string {
	return rawPrefix + "." + b.sys.typ + "." + strconv.Itoa(shard) + "." + id
}

// onRaw is the raw side's subscriber and responder.
func (b *bench) onRaw(m *nats.Msg) {
	if m.Reply != "" {
		_ = m.Respond(m.Data)
	}
	b.raw.add()
}

// runCore runs the workloads of core delivery into res.
func (b *bench) runCore(res *benchResult) error {
	if err := b.rounds(&res.Throughput); err != nil {
		return err
	}
	res.Ratio = res.Throughput.Ratio
	c := b.cfg
	if c.Requests > 0 {
		l, err := b.latency("request latency", "requests", b.request)
		if err != nil {
			return err
		}
		res.Latency = l
		if c.Callers > 0 {
			cr, err := b.concurrent()
			if err != nil {
				return err
			}
			res.Concurrent = cr
		}
		pr, err := b.pipelined()
		if err != nil {
			return err
		}
		res.Pipelined = pr
	}
	if c.LoadLatency {
		var maxReq float64 // measured by loadLatencies
		if res.Concurrent != nil {
			maxReq = res.Concurrent.Natshard.ReqsPerSec
		}
		rows, err := b.loadLatencies(res.Throughput.Natshard.MsgsPerSec, maxReq)
		if err != nil {
			return fmt.Errorf("latency under load: %w", err)
		}
		res.LoadLatency = rows
	}
	if c.Handoff {
		h, err := b.handoff()
		if err != nil {
			return fmt.Errorf("handoff run: %w", err)
		}
		res.Handoff = h
	}
	if c.Failover {
		f, err := b.failover()
		if err != nil {
			return fmt.Errorf("failover run: %w", err)
		}
		res.Failover = f
	}
	return nil
}

// runDurable runs the workloads of durable delivery into res.Durable.
func (b *bench) runDurable(res *benchResult) error {
	d := &durableResult{
		Msgs: b.cfg.Msgs, Type: b.sys.typ, Stream: kvstate.MessageStream(b.sys.typ), Raw: b.rawStream.Name, Best: b.best.stream,
		Storage: strings.ToLower(b.rawStream.Storage.String()), Replicas: b.rawStream.Replicas, BestConsumers: b.cfg.BestConsumers,
	}
	if err := b.rounds(&d.Throughput); err != nil {
		return err
	}
	d.Ratio, d.SameShapeRatio = d.Throughput.BestRatio, d.Throughput.Ratio
	if b.cfg.Requests > 0 {
		l, err := b.latency("publish-to-handled latency", "messages", b.publishHandled)
		if err != nil {
			return err
		}
		d.Latency = l
	}
	if b.cfg.LoadLatency {
		rows, err := b.loadLatencies(d.Throughput.Natshard.MsgsPerSec, 0)
		if err != nil {
			return fmt.Errorf("latency under load: %w", err)
		}
		d.LoadLatency = rows
	}
	res.Durable = d
	return nil
}

// roundSettle is the pause before each durable round: the server writes
// a file-stored consumer's state up to 100 ms after its last change, and
// that of the previous side's consumers is not this side's CPU.
const roundSettle = 300 * time.Millisecond

// rounds runs cfg.Rounds throughput runs of each side into t: natshard
// and raw NATS (or JetStream in the type's shape), and with durable
// delivery raw JetStream in its best shape too; the order of the sides
// turns from round to round.
func (b *bench) rounds(t *throughputResult) error {
	c := b.cfg
	type side struct {
		name, profile string
		res           *throughputSide
		counter       *recvCounter
		subjects      []string
		cpu           []float64
	}
	nat := &side{name: "natshard", profile: "natshard", res: &t.Natshard, counter: &b.sys.handled, subjects: b.natSubj}
	raw := &side{name: "raw NATS", profile: "raw", res: &t.Raw, counter: &b.raw, subjects: b.rawSubj}
	sides := []*side{nat, raw}
	var best *side
	if b.durable() {
		nat.name, raw.name = "natshard durable", "raw JetStream (same shape)"
		t.Best = &throughputSide{}
		best = &side{name: "raw JetStream (best shape)", profile: "best", res: t.Best, counter: &b.bestRecv, subjects: b.bestSubj}
		sides = append(sides, best)
	}
	var cpuRatios, bestCPURatios []float64
	for round := range c.Rounds {
		// Turn which side goes first, so that none always runs on a
		// warmer (or busier) machine.
		for i := range sides {
			s := sides[(round+i)%len(sides)]

			label := fmt.Sprintf("throughput %s %d/%d", s.name, round+1, c.Rounds)
			if b.durable() && !wait.Sleep(b.ctx, roundSettle) {
				return b.ctx.Err()
			}
			failed, acked, pubErrs := b.sys.failed.Load(), b.acked.Load(), b.pubErrs.Load()
			if err := b.sides.start(); err != nil {
				return err
			}
			rate, cpu, received, err := b.throughput(label, s.subjects, s.counter)
			if perr := b.sides.stop(s.profile); err == nil {
				err = perr
			}
			r := s.res
			r.Sent += int64(c.Msgs)
			r.Received += received
			r.Acked += b.acked.Load() - acked
			r.PublishErrors += b.pubErrs.Load() - pubErrs
			if s == nat {
				r.Errors += b.sys.failed.Load() - failed
			}
			if err != nil {
				if n := r.PublishErrors; n > 0 {
					err = fmt.Errorf("%w (%d publishes failed, the last with: %v)", err, n, *b.lastErr.Load())
				}
				return fmt.Errorf("%s: %w", label, err)
			}
			r.RoundsPerSec = append(r.RoundsPerSec, rate)
			s.cpu = append(s.cpu, cpu)
		}
		t.RoundsRatio = append(t.RoundsRatio, nat.res.RoundsPerSec[round]/raw.res.RoundsPerSec[round])
		if nat.cpu[round] > 0 {
			cpuRatios = append(cpuRatios, raw.cpu[round]/nat.cpu[round])
		}
		if best != nil {
			t.BestRoundsRatio = append(t.BestRoundsRatio, nat.res.RoundsPerSec[round]/best.res.RoundsPerSec[round])
			if nat.cpu[round] > 0 {
				bestCPURatios = append(bestCPURatios, best.cpu[round]/nat.cpu[round])
			}
		}
	}
	if err := b.sides.write(string(b.sys.delivery)); err != nil {
		return err
	}
	for _, s := range sides {
		s.res.CPUPerMsgUS = median(s.cpu)
		s.res.MsgsPerSec = median(s.res.RoundsPerSec)
	}
	t.CPURatio = median(cpuRatios)
	t.Ratio = median(t.RoundsRatio)
	if best != nil {
		t.BestRatio, t.BestCPURatio = median(t.BestRoundsRatio), median(bestCPURatios)
	}
	return nil
}

// throughput publishes cfg.Msgs messages to subjects, entity i%E for
// message i, from the publishers, each sending every P-th message, and
// returns the messages/s counted at the receiving side (from the first
// publish to the last message received) and the process's CPU time per
// message in microseconds. Publishers stop while window messages are
// published and not yet received. With durable delivery they publish
// through JetStream (see send) and end once every publish is
// acknowledged.
func (b *bench) throughput(label string, subjects []string, counter *recvCounter) (rate, cpuUS float64, received int64, err error) {
	total := int64(b.cfg.Msgs)
	done := counter.reset(total)
	var sent atomic.Int64
	window := int64(b.cfg.Window)
	b.prog.phase(label, total, counter.n.Load)
	defer b.prog.clear()
	start, cpu0 := since0(), processCPU()
	errs := make(chan error, len(b.pubs))
	for p := range b.pubs {
		go func() {
			const batch = 64
			for i := p; i < b.cfg.Msgs; i += len(b.pubs) {
				if err := b.send(p, subjects[i%len(subjects)]); err != nil {
					errs <- err
					return
				}
				if (i/len(b.pubs))%batch == batch-1 {
					for sent.Add(batch)-counter.n.Load() > window {
						sent.Add(-batch)
						time.Sleep(50 * time.Microsecond)
					}
				}
			}
			errs <- b.sent(p)
		}()
	}
	for range b.pubs {
		if err := <-errs; err != nil {
			return 0, 0, counter.n.Load(), err
		}
	}
	last, lastAt := int64(-1), time.Now()
	for {
		select {
		case <-done:
			cpu := float64(processCPU()-cpu0) / 1e3 / float64(total)
			return float64(total) / time.Duration(counter.end.Load()-start).Seconds(), cpu, total, nil
		case <-b.ctx.Done():
			return 0, 0, counter.n.Load(), b.ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		if n := counter.n.Load(); n != last {
			last, lastAt = n, time.Now()
		} else if time.Since(lastAt) > 10*time.Second {
			return 0, 0, n, fmt.Errorf("received %d of %d messages: %w", n, total, errNoProgress)
		}
	}
}

// send publishes the payload to subject from publisher p: a core
// publish, or with durable delivery a JetStream publish whose
// acknowledgement comes later (it waits while the publisher has
// ackWindow publishes unacknowledged).
func (b *bench) send(p int, subject string) error {
	if !b.durable() {
		return b.pubs[p].Publish(subject, b.payload)
	}
	var stalled time.Time
	for {
		_, err := b.pubJS[p].PublishAsync(subject, b.payload)
		if !errors.Is(err, jetstream.ErrTooManyStalledMsgs) {
			return err
		}
		// No acknowledgement came for 200 ms (nats.go's stall wait): wait
		// on while some come.
		if stalled.IsZero() {
			stalled = time.Now()
		} else if time.Since(stalled) > 10*time.Second {
			return fmt.Errorf("%w: %d publishes unacknowledged for 10 s", err, b.pubJS[p].PublishAsyncPending())
		}
		if b.ctx.Err() != nil {
			return b.ctx.Err()
		}
	}
}

// sent returns once what publisher p sent is on its way: flushed, or
// with durable delivery acknowledged (or failed: pubErrs counts those).
func (b *bench) sent(p int) error {
	if !b.durable() {
		return b.pubs[p].Flush()
	}
	js := b.pubJS[p]
	last, lastAt := js.PublishAsyncPending(), time.Now()
	for {
		select {
		case <-js.PublishAsyncComplete():
			return nil
		case <-b.ctx.Done():
			return b.ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		if n := js.PublishAsyncPending(); n != last {
			last, lastAt = n, time.Now()
		} else if time.Since(lastAt) > 10*time.Second {
			return fmt.Errorf("%d publishes unacknowledged for 10 s", n)
		}
	}
}

// maxLatencyErrors ends a latency run whose samples fail.
const maxLatencyErrors = 20

// latency takes cfg.Requests samples of each side, one at a time,
// alternating blocks of 50 between the sides so that both see the same
// noise, after a warm-up block each. sample sends to subject (natshard's
// when nat) and returns the time it took; what names the samples in
// errors.
func (b *bench) latency(label, what string, sample func(nat bool, subject string) (time.Duration, error)) (*latencyResult, error) {
	const block = 50
	var nat, raw []time.Duration
	var natErr, rawErr int
	n := b.cfg.Requests
	var k int
	var asked atomic.Int64 // for the progress bar
	b.prog.phase(label, int64(2*n+2*block), asked.Load)
	defer b.prog.clear()
	ask := func(isNat bool, subject string, lat *[]time.Duration, errs *int, count int, keep bool) error {
		for range count {
			d, err := sample(isNat, subject)
			asked.Add(1)
			if b.ctx.Err() != nil {
				return b.ctx.Err()
			}
			if !keep {
				continue
			}
			if err != nil {
				if *errs++; *errs == maxLatencyErrors {
					return fmt.Errorf("latency run: %d %s to %s and others failed, the last with: %w", *errs, what, subject, err)
				}
				continue
			}
			*lat = append(*lat, d)
		}
		return nil
	}
	for i := 0; i < n+block; i += block {
		keep := i > 0 // the first block of each side warms up
		count := min(block, n+block-i)
		e := k % len(b.ids)
		k++
		if err := ask(true, b.natSubj[e], &nat, &natErr, count, keep); err != nil {
			return nil, err
		}
		if err := ask(false, b.rawSubj[e], &raw, &rawErr, count, keep); err != nil {
			return nil, err
		}
	}
	l := &latencyResult{Natshard: latencyOf(nat, natErr), Raw: latencyOf(raw, rawErr)}
	l.P50DiffUS = l.Natshard.P50US - l.Raw.P50US
	if len(nat) == 0 || len(raw) == 0 {
		return l, fmt.Errorf("latency run: every sample failed (natshard %d errors, raw %d errors)", natErr, rawErr)
	}
	return l, nil
}

// The concurrent callers' run and the pipelined run: requestRounds
// rounds per side (issue 14's targets are medians of 5), each of
// requestFactor times --requests requests (a round of 5 000 requests
// took 70 ms, too short for its ratio to mean much).
const (
	requestRounds = 5
	requestFactor = 4
)

// concurrent runs cfg.Callers callers, requestRounds rounds per side,
// each round requestFactor*cfg.Requests requests to the entities
// round-robin: through a natshard.Client on the requester's connection,
// and with nc.Request on it to the raw responders; the sides take turns
// going first.
func (b *bench) concurrent() (*concurrentResult, error) {
	c := b.cfg
	opts := []natshard.ClientOption{natshard.WithTimeout(c.Timeout)}
	if c.DataPrefix != "" {
		opts = append(opts, natshard.WithPrefix(c.DataPrefix))
	}
	client := natshard.NewClient(b.requester, opts...)
	if _, err := client.Request(b.ctx, b.sys.typ, b.ids[0], b.reqBody); err != nil { // learns the type
		return nil, fmt.Errorf("client request: %w", err)
	}
	n := requestFactor * c.Requests
	res := &concurrentResult{Callers: c.Callers, requestRuns: requestRuns{Requests: n, Rounds: requestRounds}}
	var done atomic.Int64
	b.prog.phase(fmt.Sprintf("requests, %d callers", c.Callers), int64(2*requestRounds*n), done.Load)
	defer b.prog.clear()
	// A round of one side: natshard's, or raw NATS's.
	round := func(nat bool) (float64, int64, error) {
		var next, errs atomic.Int64
		var firstErr atomic.Pointer[error]
		var wg sync.WaitGroup
		t0 := time.Now()
		for range c.Callers {
			wg.Go(func() {
				for i := int(next.Add(1)) - 1; i < n && b.ctx.Err() == nil; i = int(next.Add(1)) - 1 {
					e := i % len(b.ids)
					var err error
					if nat {
						_, err = client.Request(b.ctx, b.sys.typ, b.ids[e], b.reqBody)
					} else {
						_, err = b.requester.Request(b.rawSubj[e], b.reqBody, c.Timeout)
					}
					done.Add(1)
					if err != nil {
						errs.Add(1)
						firstErr.CompareAndSwap(nil, &err)
					}
				}
			})
		}
		wg.Wait()
		d := time.Since(t0)
		if err := b.ctx.Err(); err != nil {
			return 0, 0, err
		}
		if failed := errs.Load(); failed > maxLatencyErrors {
			return 0, failed, fmt.Errorf("%d of %d requests failed, the first with: %w", failed, n, *firstErr.Load())
		}
		return float64(n) / d.Seconds(), errs.Load(), nil
	}
	if err := res.alternate(round); err != nil {
		return nil, fmt.Errorf("concurrent callers' run: %w", err)
	}
	return res, nil
}

// alternate runs r.Rounds rounds of natshard's side (run(true)) and of
// raw NATS's (run(false)), the sides taking turns going first, and sets
// r's rates and ratios. run returns a round's requests per second and its
// errors.
func (r *requestRuns) alternate(run func(nat bool) (float64, int64, error)) error {
	for round := range r.Rounds {
		for _, nat := range []bool{round%2 == 0, round%2 == 1} {
			side := &r.Raw
			if nat {
				side = &r.Natshard
			}
			rate, errs, err := run(nat)
			side.Errors += errs
			if err != nil {
				return err
			}
			side.RoundsPerSec = append(side.RoundsPerSec, rate)
		}
		r.RoundsRatio = append(r.RoundsRatio, r.Natshard.RoundsPerSec[round]/r.Raw.RoundsPerSec[round])
	}
	r.Natshard.ReqsPerSec = median(r.Natshard.RoundsPerSec)
	r.Raw.ReqsPerSec = median(r.Raw.RoundsPerSec)
	r.Ratio = median(r.RoundsRatio)
	return nil
}

// pipelineWindow is how many pipelined requests are in flight.
const pipelineWindow = 256

// pipelined keeps pipelineWindow requests in flight from the requester's
// connection, all answered to one reply subject, to the echo entities and
// to the raw responders in turn (issue 14: natshard's request throughput
// against a plain responder's).
func (b *bench) pipelined() (*pipelinedResult, error) {
	n := requestFactor * b.cfg.Requests
	res := &pipelinedResult{Window: pipelineWindow, requestRuns: requestRuns{Requests: n, Rounds: requestRounds}}
	type run struct {
		nat      bool // to the entities
		slots    chan struct{}
		answered atomic.Int64
		errs     atomic.Int64
		done     chan struct{}
	}
	var cur atomic.Pointer[run]
	echo := b.cfg.Kind == "echo" // the raw responders echo; kv entities answer with a value
	reply := nats.NewInbox()
	sub, err := b.requester.Subscribe(reply, func(m *nats.Msg) {
		r := cur.Load()
		if r == nil {
			return
		}
		// An entity's error, the server's "no responders" (status 503),
		// or not the echo of the request.
		if m.Header.Get(protocol.HeaderError) != "" || m.Header.Get("Status") == "503" ||
			(echo || !r.nat) && !bytes.Equal(m.Data, b.reqBody) {
			r.errs.Add(1)
		}
		select {
		case <-r.slots:
		default:
		}
		if r.answered.Add(1) == int64(n) {
			close(r.done)
		}
	})
	if err != nil {
		return nil, fmt.Errorf("pipelined requests: %w", err)
	}
	defer sub.Unsubscribe()
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		return nil, fmt.Errorf("pipelined requests: %w", err)
	}
	var done atomic.Int64
	b.prog.phase(fmt.Sprintf("requests, %d in flight", pipelineWindow), int64(2*requestRounds*n), done.Load)
	defer b.prog.clear()
	one := func(nat bool) (float64, int64, error) {
		subjects := b.rawSubj
		if nat {
			subjects = b.natSubj
		}
		r := &run{nat: nat, slots: make(chan struct{}, pipelineWindow), done: make(chan struct{})}
		cur.Store(r)
		defer cur.Store(nil)
		stall := time.NewTimer(b.cfg.Timeout)
		defer stall.Stop()
		t0 := time.Now()
		for i := range n {
			select {
			case r.slots <- struct{}{}:
			case <-stall.C:
				return 0, 0, fmt.Errorf("%d of %d requests answered, none for %v", r.answered.Load(), n, b.cfg.Timeout)
			case <-b.ctx.Done():
				return 0, 0, b.ctx.Err()
			}
			stall.Reset(b.cfg.Timeout)
			if err := b.requester.PublishMsg(&nats.Msg{Subject: subjects[i%len(subjects)], Reply: reply, Data: b.reqBody}); err != nil {
				return 0, 0, err
			}
			done.Add(1)
		}
		if err := b.requester.Flush(); err != nil {
			return 0, 0, err
		}
		select {
		case <-r.done:
		case <-stall.C:
			return 0, 0, fmt.Errorf("%d of %d requests answered %v after the last was sent", r.answered.Load(), n, b.cfg.Timeout)
		case <-b.ctx.Done():
			return 0, 0, b.ctx.Err()
		}
		rate := float64(n) / time.Since(t0).Seconds()
		if errs := r.errs.Load(); errs > maxLatencyErrors {
			return 0, errs, fmt.Errorf("%d of %d requests answered with an error", errs, n)
		}
		return rate, r.errs.Load(), nil
	}
	if err := res.alternate(one); err != nil {
		return nil, fmt.Errorf("pipelined requests: %w", err)
	}
	return res, nil
}

// request is a sample of core delivery's latency: a request and its
// answer.
func (b *bench) request(_ bool, subject string) (time.Duration, error) {
	t0 := time.Now()
	m, err := b.requester.Request(subject, b.reqBody, b.cfg.Timeout)
	d := time.Since(t0)
	if err == nil && m.Header.Get(protocol.HeaderError) != "" {
		err = errors.New(m.Header.Get(protocol.HeaderError))
	}
	return d, err
}

// publishHandled is a sample of durable delivery's latency: a JetStream
// publish of the payload to subject, to the moment its entity (or raw
// consumer) handled it; it returns once the publish is acknowledged too.
func (b *bench) publishHandled(nat bool, subject string) (time.Duration, error) {
	counter := &b.raw
	if nat {
		counter = &b.sys.handled
	}
	failed := b.sys.failed.Load()
	done := counter.reset(1)
	t0 := since0()
	paf, err := b.reqJS.PublishAsync(subject, b.payload)
	if err != nil {
		return 0, err
	}
	timeout := time.NewTimer(b.cfg.Timeout)
	defer timeout.Stop()
	select {
	case <-done:
	case <-timeout.C:
		return 0, fmt.Errorf("not handled %v after its publish", b.cfg.Timeout)
	case <-b.ctx.Done():
		return 0, b.ctx.Err()
	}
	d := time.Duration(counter.end.Load() - t0)
	select {
	case <-paf.Ok():
	case err := <-paf.Err():
		return 0, err
	case <-timeout.C:
		return 0, fmt.Errorf("handled, but not acknowledged %v after its publish", b.cfg.Timeout)
	case <-b.ctx.Done():
		return 0, b.ctx.Err()
	}
	if b.sys.failed.Load() != failed {
		return 0, errors.New("the entity failed to handle it")
	}
	return d, nil
}

func latencyOf(d []time.Duration, errs int) latencySide {
	slices.Sort(d)
	us := func(q float64) float64 { return float64(percentile(d, q)) / 1e3 }
	return latencySide{Count: len(d), Errors: errs, P50US: us(0.50), P99US: us(0.99), P999US: us(0.999), MaxUS: us(1)}
}

// percentile is the nearest-rank q-quantile of sorted d (0 for none).
func percentile(d []time.Duration, q float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	i := int(q*float64(len(d))+0.999999) - 1
	return d[min(max(i, 0), len(d)-1)]
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(v))
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func ms(d time.Duration) float64 { return float64(d) / 1e6 }

// background publishes to subjects round-robin at rate messages/s until
// the returned function is called.
func (b *bench) background(subjects []string, rate float64) (stop func()) {
	quit, done := make(chan struct{}), make(chan struct{})
	nc := b.pubs[0]
	go func() {
		defer close(done)
		t := time.NewTicker(time.Millisecond)
		defer t.Stop()
		start, sent := time.Now(), 0
		for {
			select {
			case <-quit:
				return
			case <-t.C:
			}
			due := int(time.Since(start).Seconds() * rate)
			for ; sent < due; sent++ {
				_ = nc.Publish(subjects[sent%len(subjects)], b.payload)
			}
		}
	}()
	return func() { close(quit); <-done }
}

// touch sends one request to each subject (a bounded number in flight),
// retrying failures for a while (a shard may be moving), so that every
// entity is active.
func (b *bench) touch(subjects []string) error {
	const inFlight = 64
	work := make(chan string)
	var failed atomic.Pointer[error]
	var wg sync.WaitGroup
	for range inFlight {
		wg.Go(func() {
			for subj := range work {
				var err error
				for try := 0; try < 100; try++ {
					var m *nats.Msg
					if m, err = b.requester.Request(subj, b.reqBody, b.cfg.Timeout); err == nil && m.Header.Get(protocol.HeaderError) != "" {
						err = errors.New(m.Header.Get(protocol.HeaderError))
					}
					if err == nil {
						break
					}
					time.Sleep(20 * time.Millisecond)
				}
				if err != nil {
					failed.CompareAndSwap(nil, &err)
				}
			}
		})
	}
	for _, s := range subjects {
		work <- s
	}
	close(work)
	wg.Wait()
	if err := failed.Load(); err != nil {
		return fmt.Errorf("activate entities: %w", *err)
	}
	return nil
}

// handoff moves one shard with cfg.HandoffEntities active entities back
// and forth between two regions, cfg.Moves times, while a publisher sends
// to its entities at cfg.Rate. One sample is the time from the move
// request (the decision) to the new owner's first Handle of a message of
// the shard.
func (b *bench) handoff() (*handoffResult, error) {
	st, err := b.sys.status()
	if err != nil {
		return nil, err
	}
	const shard = 0
	owner := st.Table[shard].Region
	var subjects []string
	for i := 0; len(subjects) < b.cfg.HandoffEntities; i++ {
		id := "h-" + strconv.Itoa(i)
		if protocol.ShardOf(id, b.cfg.Shards) == shard {
			subjects = append(subjects, b.sys.subjects.Entity(shard, id))
		}
	}
	stop := b.background(subjects, b.cfg.Rate)
	defer stop()
	res := &handoffResult{Entities: b.cfg.HandoffEntities, Moves: b.cfg.Moves, Rate: b.cfg.Rate}
	var samples []time.Duration
	var moved atomic.Int64 // for the progress bar
	b.prog.phase("handoffs", int64(b.cfg.Moves), moved.Load)
	defer b.prog.clear()
	for range b.cfg.Moves {
		if err := b.touch(subjects); err != nil {
			return nil, err
		}
		ids := b.sys.regionIDs()
		target := ids[(slices.Index(ids, owner)+1)%len(ids)]
		first := b.sys.region(target).probe.arm(shard)
		t0 := since0()
		if err := b.sys.adminRequest(protocol.AdminMove, protocol.MoveRequest{Shard: shard, Region: target}); err != nil {
			return nil, err
		}
		select {
		case <-first:
		case <-time.After(30 * time.Second):
			return nil, fmt.Errorf("shard %d: region %s handled no message of it 30 s after the move to it", shard, target)
		case <-b.ctx.Done():
			return nil, b.ctx.Err()
		}
		d := time.Duration(b.sys.region(target).probe.first.Load() - t0)
		samples = append(samples, d)
		res.Samples = append(res.Samples, ms(d))
		if err := b.waitOwner(shard, target); err != nil {
			return nil, err
		}
		moved.Add(1)
		owner = target
	}
	slices.Sort(samples)
	res.P50MS, res.P99MS, res.MaxMS = ms(percentile(samples, 0.5)), ms(percentile(samples, 0.99)), ms(percentile(samples, 1))
	return res, nil
}

// waitOwner waits until shard is active on target and served live.
func (b *bench) waitOwner(shard int, target string) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		st, err := b.sys.status()
		if err == nil && st.Table[shard].Region == target && st.Table[shard].State == string(protocol.StateActive) && b.sys.allLive([]string{target}) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("shard %d not active on %s 30 s after its move (last status error: %v)", shard, target, err)
		}
		if b.ctx.Err() != nil {
			return b.ctx.Err()
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// failover kills the newest region cfg.Kills times (its connection closes
// at once, as at a kill -9; the coordinator learns it from the embedded
// server's disconnect advisory, or from its probes on a --nats server) while
// a publisher sends to every entity at cfg.Rate, and measures the time
// from the kill until the coordinator's table shows every shard of the
// dead region parked (or further), and until they are all active on the
// survivors. After each kill a new region joins and the shards are
// rebalanced.
func (b *bench) failover() (*failoverResult, error) {
	stop := b.background(b.natSubj, b.cfg.Rate)
	defer stop()
	res := &failoverResult{Kills: b.cfg.Kills, Rate: b.cfg.Rate}
	var parked, rehomed []time.Duration
	var killed atomic.Int64 // for the progress bar
	b.prog.phase("region crashes", int64(b.cfg.Kills), killed.Load)
	defer b.prog.clear()
	for range b.cfg.Kills {
		st, err := b.sys.status()
		if err != nil {
			return nil, err
		}
		ids := b.sys.regionIDs()
		victim := ids[len(ids)-1]
		shards := owners(st)[victim]
		t0 := time.Now()
		b.sys.crash(victim)
		var parkedAt time.Duration
		for {
			st, err := b.sys.status()
			if err == nil {
				away, home := 0, 0
				for _, n := range shards {
					r := st.Table[n]
					if r.Region != victim || r.State != string(protocol.StateActive) {
						away++
					}
					if r.Region != victim && r.State == string(protocol.StateActive) {
						home++
					}
				}
				if away == len(shards) && parkedAt == 0 {
					parkedAt = time.Since(t0)
				}
				if home == len(shards) {
					break
				}
			}
			if time.Since(t0) > 60*time.Second {
				return nil, fmt.Errorf("the shards of crashed region %s were not re-homed in 60 s", victim)
			}
			if b.ctx.Err() != nil {
				return nil, b.ctx.Err()
			}
			time.Sleep(2 * time.Millisecond)
		}
		d := time.Since(t0)
		parked, rehomed = append(parked, parkedAt), append(rehomed, d)
		res.Rehomed = append(res.Rehomed, ms(d))
		if _, err := b.sys.startRegion(b.ctx); err != nil {
			return nil, err
		}
		if _, err := b.sys.waitBalanced(b.ctx, 60*time.Second); err != nil {
			return nil, err
		}
		killed.Add(1)
	}
	var took []time.Duration
	for range b.cfg.Kills {
		d, err := b.sys.crashCoordinator(b.ctx)
		if err != nil {
			return nil, err
		}
		took = append(took, d)
		res.Coordinator = append(res.Coordinator, ms(d))
	}
	slices.Sort(took)
	res.CoordinatorP50MS, res.CoordinatorMaxMS = ms(percentile(took, 0.5)), ms(percentile(took, 1))
	slices.Sort(parked)
	slices.Sort(rehomed)
	res.ParkedP50MS, res.ParkedMaxMS = ms(percentile(parked, 0.5)), ms(percentile(parked, 1))
	res.RehomedP50MS, res.RehomedP99MS, res.RehomedMaxMS = ms(percentile(rehomed, 0.5)), ms(percentile(rehomed, 0.99)), ms(percentile(rehomed, 1))
	return res, nil
}
