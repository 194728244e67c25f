package benchlab

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/internal/wait"
)

// runCore runs the workloads of core delivery into res.
func (b *bench) runCore(res *Result) error {
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
func (b *bench) runDurable(res *Result) error {
	d := &DurableResult{
		Msgs: b.cfg.Msgs, Type: b.sys.cfg.Type, Stream: b.msgStreams[0], Streams: len(b.msgStreams), Raw: b.rawStreams[0].Name, Best: b.best.stream,
		Storage: strings.ToLower(b.rawStreams[0].Storage.String()), Replicas: b.rawStreams[0].Replicas, BestConsumers: b.cfg.BestConsumers,
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
func (b *bench) rounds(t *ThroughputResult) error {
	c := b.cfg
	type side struct {
		name, profile string
		res           *ThroughputSide
		counter       *recvCounter
		subjects      []string
		cpu           []float64
	}
	nat := &side{name: "natshard", profile: "natshard", res: &t.Natshard, counter: &b.tally.handled, subjects: b.natSubj}
	raw := &side{name: "raw NATS", profile: "raw", res: &t.Raw, counter: &b.raw, subjects: b.rawSubj}
	sides := []*side{nat, raw}
	var best *side
	if b.durable() {
		nat.name, raw.name = "natshard durable", "raw JetStream (same shape)"
		t.Best = &ThroughputSide{}
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
			failed, acked, pubErrs := b.tally.failed.Load(), b.acked.Load(), b.pubErrs.Load()
			if err := b.sides.Start(); err != nil {
				return err
			}
			rate, cpu, received, err := b.throughput(label, s.subjects, s.counter)
			if perr := b.sides.Stop(s.profile); err == nil {
				err = perr
			}
			r := s.res
			r.Sent += int64(c.Msgs)
			r.Received += received
			r.Acked += b.acked.Load() - acked
			r.PublishErrors += b.pubErrs.Load() - pubErrs
			if s == nat {
				r.Errors += b.tally.failed.Load() - failed
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
	if err := b.sides.Write(string(b.sys.cfg.Delivery)); err != nil {
		return err
	}
	for _, s := range sides {
		s.res.CPUPerMsgUS = Median(s.cpu)
		s.res.MsgsPerSec = Median(s.res.RoundsPerSec)
	}
	t.CPURatio = Median(cpuRatios)
	t.Ratio = Median(t.RoundsRatio)
	if best != nil {
		t.BestRatio, t.BestCPURatio = Median(t.BestRoundsRatio), Median(bestCPURatios)
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
	start, cpu0 := since0(), ProcessCPU()
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
			cpu := float64(ProcessCPU()-cpu0) / 1e3 / float64(total)
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
