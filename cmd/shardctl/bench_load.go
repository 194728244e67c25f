package main

import (
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
	ctx  context.Context
	cfg  benchConfig
	sys  *benchSystem
	prog *progress

	pubs      []*nats.Conn // publishers, for both sides
	requester *nats.Conn   // latency and handoff requests, for both sides
	raw       recvCounter  // what the raw subscribers received
	ids       []string     // entity ids
	natSubj   []string     // natshard subject of each entity
	rawSubj   []string     // raw subject of each entity: same depth, another prefix
	payload   []byte       // throughput payload
	reqBody   []byte       // latency request
}

// rawPrefix is the first token of the raw NATS side's subjects.
const rawPrefix = "rawbench"

// newBench opens the publishers and the raw side: one subscriber
// connection per region, each subscribed to the same shards (raw
// subjects) as its region.
func newBench(ctx context.Context, sys *benchSystem, prog *progress) (*bench, error) {
	cfg := sys.cfg
	b := &bench{ctx: ctx, cfg: cfg, sys: sys, prog: prog}
	b.raw.reset(0)
	sys.handled.reset(0)
	for i := range cfg.Pubs {
		nc, err := sys.connect("pub-" + strconv.Itoa(i))
		if err != nil {
			return nil, err
		}
		b.pubs = append(b.pubs, nc)
	}
	var err error
	if b.requester, err = sys.connect("requester"); err != nil {
		return nil, err
	}
	st, err := sys.status()
	if err != nil {
		return nil, fmt.Errorf("coordinator status: %w", err)
	}
	own := owners(st)
	for _, id := range sys.regionIDs() {
		nc, err := sys.connect("raw-" + id)
		if err != nil {
			return nil, err
		}
		for _, shard := range own[id] {
			sub, err := nc.Subscribe(b.rawShard(shard), b.onRaw)
			if err != nil {
				return nil, err
			}
			_ = sub.SetPendingLimits(-1, -1) // as a region's shard subscriptions
		}
		if err := nc.Flush(); err != nil {
			return nil, err
		}
	}
	for i := range cfg.Entities {
		id := "e-" + strconv.Itoa(i)
		shard := protocol.ShardOf(id, cfg.Shards)
		b.ids = append(b.ids, id)
		b.natSubj = append(b.natSubj, sys.subjects.Entity(shard, id))
		b.rawSubj = append(b.rawSubj, b.rawEntity(shard, id))
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
	return b, nil
}

func (b *bench) rawShard(shard int) string {
	return rawPrefix + "." + b.cfg.Type + "." + strconv.Itoa(shard) + ".>"
}

func (b *bench) rawEntity(shard int, id string) string {
	return rawPrefix + "." + b.cfg.Type + "." + strconv.Itoa(shard) + "." + id
}

// onRaw is the raw side's subscriber and responder.
func (b *bench) onRaw(m *nats.Msg) {
	if m.Reply != "" {
		_ = m.Respond(m.Data)
	}
	b.raw.add()
}

// run runs every workload asked for.
func (b *bench) run() (*benchResult, error) {
	server := "embedded"
	if b.cfg.NATS != "" {
		server = b.cfg.NATS
	}
	c := b.cfg
	res := &benchResult{
		Config: benchConfigView{Server: server, Type: c.Type, Regions: c.Regions, Shards: c.Shards, Kind: c.Kind, Entities: c.Entities,
			Msgs: c.Msgs, Size: c.Size, Pubs: c.Pubs, Window: c.Window, Rounds: c.Rounds, Requests: c.Requests},
		Machine: machine(),
	}
	t := &res.Throughput
	var natCPU, rawCPU, cpuRatios []float64
	for round := range c.Rounds {
		// Alternate which side goes first, so that neither always runs
		// on a warmer (or busier) machine.
		sides := []bool{round%2 == 1, round%2 == 0} // natshard?
		for _, nat := range sides {
			side, counter, subjects, name := &t.Raw, &b.raw, b.rawSubj, "raw NATS"
			if nat {
				side, counter, subjects, name = &t.Natshard, &b.sys.handled, b.natSubj, "natshard"
			}
			label := fmt.Sprintf("throughput %s %d/%d", name, round+1, c.Rounds)
			failed := b.sys.failed.Load()
			rate, cpu, received, err := b.throughput(label, subjects, counter)
			side.Sent += int64(c.Msgs)
			side.Received += received
			if nat {
				side.Errors += b.sys.failed.Load() - failed
			}
			if err != nil {
				return nil, fmt.Errorf("%s: %w", label, err)
			}
			side.RoundsPerSec = append(side.RoundsPerSec, rate)
			if nat {
				natCPU = append(natCPU, cpu)
			} else {
				rawCPU = append(rawCPU, cpu)
			}
		}
		t.RoundsRatio = append(t.RoundsRatio, t.Natshard.RoundsPerSec[round]/t.Raw.RoundsPerSec[round])
		if natCPU[round] > 0 {
			cpuRatios = append(cpuRatios, rawCPU[round]/natCPU[round])
		}
	}
	t.Natshard.CPUPerMsgUS, t.Raw.CPUPerMsgUS, t.CPURatio = median(natCPU), median(rawCPU), median(cpuRatios)
	t.Natshard.MsgsPerSec = median(t.Natshard.RoundsPerSec)
	t.Raw.MsgsPerSec = median(t.Raw.RoundsPerSec)
	t.Ratio = median(t.RoundsRatio)
	res.Ratio = t.Ratio
	if c.Requests > 0 {
		l, err := b.latency()
		if err != nil {
			return nil, err
		}
		res.Latency = l
	}
	if c.Handoff {
		h, err := b.handoff()
		if err != nil {
			return nil, fmt.Errorf("handoff run: %w", err)
		}
		res.Handoff = h
	}
	if c.Failover {
		f, err := b.failover()
		if err != nil {
			return nil, fmt.Errorf("failover run: %w", err)
		}
		res.Failover = f
	}
	return res, nil
}

// throughput publishes cfg.Msgs messages to subjects, entity i%E for
// message i, from the publishers, each sending every P-th message, and
// returns the messages/s counted at the receiving side (from the first
// publish to the last message received) and the process's CPU time per
// message in microseconds. Publishers stop while window messages are
// published and not yet received.
func (b *bench) throughput(label string, subjects []string, counter *recvCounter) (rate, cpuUS float64, received int64, err error) {
	total := int64(b.cfg.Msgs)
	done := counter.reset(total)
	var sent atomic.Int64
	window := int64(b.cfg.Window)
	b.prog.phase(label, total, counter.n.Load)
	defer b.prog.clear()
	start, cpu0 := since0(), processCPU()
	errs := make(chan error, len(b.pubs))
	for p, nc := range b.pubs {
		go func() {
			const batch = 64
			for i := p; i < b.cfg.Msgs; i += len(b.pubs) {
				if err := nc.Publish(subjects[i%len(subjects)], b.payload); err != nil {
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
			errs <- nc.Flush()
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

// maxLatencyErrors ends a latency run whose requests fail.
const maxLatencyErrors = 20

// latency sends cfg.Requests requests to each side from one requester,
// one at a time, alternating blocks of 50 between the sides so that both
// see the same noise, after a warm-up block each.
func (b *bench) latency() (*latencyResult, error) {
	const block = 50
	var nat, raw []time.Duration
	var natErr, rawErr int
	n := b.cfg.Requests
	var k int
	var asked atomic.Int64 // for the progress bar
	b.prog.phase("request latency", int64(2*n+2*block), asked.Load)
	defer b.prog.clear()
	ask := func(subject string, lat *[]time.Duration, errs *int, count int, keep bool) error {
		for range count {
			t0 := time.Now()
			m, err := b.requester.Request(subject, b.reqBody, b.cfg.Timeout)
			d := time.Since(t0)
			asked.Add(1)
			if b.ctx.Err() != nil {
				return b.ctx.Err()
			}
			if err == nil && m.Header.Get(protocol.HeaderError) != "" {
				err = errors.New(m.Header.Get(protocol.HeaderError))
			}
			if !keep {
				continue
			}
			if err != nil {
				if *errs++; *errs == maxLatencyErrors {
					return fmt.Errorf("latency run: %d requests to %s and others failed, the last with: %w", *errs, subject, err)
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
		if err := ask(b.natSubj[e], &nat, &natErr, count, keep); err != nil {
			return nil, err
		}
		if err := ask(b.rawSubj[e], &raw, &rawErr, count, keep); err != nil {
			return nil, err
		}
	}
	l := &latencyResult{Natshard: latencyOf(nat, natErr), Raw: latencyOf(raw, rawErr)}
	l.P50DiffUS = l.Natshard.P50US - l.Raw.P50US
	if len(nat) == 0 || len(raw) == 0 {
		return l, fmt.Errorf("latency run: every request failed (natshard %d errors, raw %d errors)", natErr, rawErr)
	}
	return l, nil
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
// at once, as at a kill -9; the coordinator notices by its probes) while
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
	slices.Sort(parked)
	slices.Sort(rehomed)
	res.ParkedP50MS, res.ParkedMaxMS = ms(percentile(parked, 0.5)), ms(percentile(parked, 1))
	res.RehomedP50MS, res.RehomedP99MS, res.RehomedMaxMS = ms(percentile(rehomed, 0.5)), ms(percentile(rehomed, 0.99)), ms(percentile(rehomed, 1))
	return res, nil
}
