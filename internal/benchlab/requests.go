package benchlab

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/protocol"
)

// maxLatencyErrors ends a latency run whose samples fail.
const maxLatencyErrors = 20

// latency takes cfg.Requests samples of each side, one at a time,
// alternating blocks of 50 between the sides so that both see the same
// noise, after a warm-up block each. sample sends to subject (natshard's
// when nat) and returns the time it took; what names the samples in
// errors.
func (b *bench) latency(label, what string, sample func(nat bool, subject string) (time.Duration, error)) (*LatencyResult, error) {
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
	l := &LatencyResult{Natshard: latencyOf(nat, natErr), Raw: latencyOf(raw, rawErr)}
	l.P50DiffUS = l.Natshard.P50US - l.Raw.P50US
	if len(nat) == 0 || len(raw) == 0 {
		return l, fmt.Errorf("latency run: every sample failed (natshard %d errors, raw %d errors)", natErr, rawErr)
	}
	return l, nil
}

// The concurrent callers' run and the pipelined run: RequestRounds
// rounds per side (issue 14's targets are medians of 5), each of
// RequestFactor times --requests requests (a round of 5 000 requests
// took 70 ms, too short for its ratio to mean much).
const (
	RequestRounds = 5
	RequestFactor = 4
)

// concurrent runs cfg.Callers callers, RequestRounds rounds per side,
// each round RequestFactor*cfg.Requests requests to the entities
// round-robin: through a natshard.Client on the requester's connection,
// and with nc.Request on it to the raw responders; the sides take turns
// going first.
func (b *bench) concurrent() (*ConcurrentResult, error) {
	c := b.cfg
	opts := []natshard.ClientOption{natshard.WithTimeout(c.Timeout)}
	if c.DataPrefix != "" {
		opts = append(opts, natshard.WithPrefix(c.DataPrefix))
	}
	client := natshard.NewClient(b.requester, opts...)
	if _, err := client.Request(b.ctx, b.sys.cfg.Type, b.ids[0], b.reqBody); err != nil { // learns the type
		return nil, fmt.Errorf("client request: %w", err)
	}
	n := RequestFactor * c.Requests
	res := &ConcurrentResult{Callers: c.Callers, RequestRuns: RequestRuns{Requests: n, Rounds: RequestRounds}}
	var done atomic.Int64
	b.prog.phase(fmt.Sprintf("requests, %d callers", c.Callers), int64(2*RequestRounds*n), done.Load)
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
						_, err = client.Request(b.ctx, b.sys.cfg.Type, b.ids[e], b.reqBody)
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
func (r *RequestRuns) alternate(run func(nat bool) (float64, int64, error)) error {
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
	r.Natshard.ReqsPerSec = Median(r.Natshard.RoundsPerSec)
	r.Raw.ReqsPerSec = Median(r.Raw.RoundsPerSec)
	r.Ratio = Median(r.RoundsRatio)
	return nil
}

// PipelineWindow is how many pipelined requests are in flight.
const PipelineWindow = 256

// pipelined keeps PipelineWindow requests in flight from the requester's
// connection, all answered to one reply subject, to the echo entities and
// to the raw responders in turn (issue 14: natshard's request throughput
// against a plain responder's).
func (b *bench) pipelined() (*PipelinedResult, error) {
	n := RequestFactor * b.cfg.Requests
	res := &PipelinedResult{Window: PipelineWindow, RequestRuns: RequestRuns{Requests: n, Rounds: RequestRounds}}
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
	b.prog.phase(fmt.Sprintf("requests, %d in flight", PipelineWindow), int64(2*RequestRounds*n), done.Load)
	defer b.prog.clear()
	one := func(nat bool) (float64, int64, error) {
		subjects := b.rawSubj
		if nat {
			subjects = b.natSubj
		}
		r := &run{nat: nat, slots: make(chan struct{}, PipelineWindow), done: make(chan struct{})}
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
		counter = &b.tally.handled
	}
	failed := b.tally.failed.Load()
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
	if b.tally.failed.Load() != failed {
		return 0, errors.New("the entity failed to handle it")
	}
	return d, nil
}

func latencyOf(d []time.Duration, errs int) LatencySide {
	slices.Sort(d)
	us := func(q float64) float64 { return float64(Percentile(d, q)) / 1e3 }
	return LatencySide{Count: len(d), Errors: errs, P50US: us(0.50), P99US: us(0.99), P999US: us(0.999), MaxUS: us(1)}
}
