package benchlab

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/wait"
)

// The latency tables under load (--load-latency), in the form users
// compare (Restate publishes p50 and p99 at a low and a high load): at a
// low rate (--low-rate, 1 000 msgs/s) and at 80 % of the maximum natshard
// reached in the same run, for --load-seconds each, natshard alone:
//
//   - publish to handled: messages published at the rate (JetStream
//     publishes in durable delivery, acknowledged later), each with its
//     time in the header benchSentHeader, which the entity's wrapper
//     reads when it handles it;
//   - request round trip: requests sent at the rate through
//     natshard.Client.Request (durable delivery: stored, then answered),
//     each timed by its caller from the call to the answer.
//
// The maximum of publishes is what the same open loop sustains: the
// load is sent at the throughput rounds' median msgs/s (flow-controlled
// publishers without headers: a closed loop, which an open loop of
// messages with a header does not reach on a small machine) for
// --load-seconds, and the msgs/s it handled, from its first publish to
// its last message handled, is the maximum (LoadLatency.Max; the closed
// loop's is ClosedMax). 80 % of a closed loop's maximum overloaded the
// open loop (core delivery then dropped most of the load, durable
// delivery queued it), which measures a queue, not natshard. For
// requests the maximum is the req/s of concurrent callers through the
// Client (core delivery: the concurrent run's median, --callers; durable
// delivery, or without that run: loadCallers callers for --load-seconds,
// measured before the table).

// benchSentHeader carries a load message's publish time (since0, in ns).
const benchSentHeader = "Bench-Sent"

// highLoad is the high load's share of the maximum.
const highLoad = 0.8

// LoadLatency is one row of the table.
type LoadLatency struct {
	Load    string       `json:"load"`     // "low" or "80%"
	Rate    float64      `json:"rate"`     // msgs/s asked for
	ReqRate float64      `json:"req_rate"` // req/s asked for
	Handled LatencyPoint `json:"handled"`  // publish to handled
	Request LatencyPoint `json:"request"`  // request round trip
	// Max is, for the high load, the publishes' maximum it is a share
	// of: msgs/s handled by the open loop sent at ClosedMax, the
	// throughput rounds' median. 0 for the low load.
	Max       float64 `json:"max,omitempty"`
	ClosedMax float64 `json:"closed_max,omitempty"`
}

// LatencyPoint is the percentiles of one load's samples, rates as sent.
type LatencyPoint struct {
	Rate float64 `json:"rate"` // achieved: samples over the time taken to send them
	// Handled is, for publishes, the messages handled per second, from
	// the first publish to the last message handled: below Rate when the
	// load queued.
	Handled float64 `json:"handled_rate,omitempty"`
	Count   int64   `json:"count"`
	Errors  int64   `json:"errors"` // failed, or (core publishes) never handled
	P50US   float64 `json:"p50_us"`
	P90US   float64 `json:"p90_us"`
	P99US   float64 `json:"p99_us"`
}

// loadCallers is how many callers measure the maximum request rate.
const loadCallers = 64

// loadLatencies measures the table: low load, then high. maxPub and
// maxReq are the maxima in msgs/s and req/s (0: measured here).
func (b *bench) loadLatencies(maxPub, maxReq float64) ([]LoadLatency, error) {
	low := b.cfg.LowRate
	if maxReq == 0 {
		if err := b.quiesce(); err != nil {
			return nil, err
		}
		var err error
		if maxReq, err = b.requestMax(); err != nil {
			return nil, fmt.Errorf("the maximum request rate: %w", err)
		}
	}
	if err := b.quiesce(); err != nil {
		return nil, err
	}
	open, err := b.loadHandled("the maximum", maxPub)
	if err != nil {
		return nil, fmt.Errorf("publishes at the maximum, %.0f msgs/s: %w", maxPub, err)
	}
	var rows []LoadLatency
	for _, l := range []struct {
		name       string
		pub, req   float64
		max, asked float64
	}{{"low", low, low, 0, 0}, {fmt.Sprintf("%.0f%%", 100*highLoad), highLoad * open.Handled, highLoad * maxReq, open.Handled, maxPub}} {
		row := LoadLatency{Load: l.name, Rate: l.pub, ReqRate: l.req, Max: l.max, ClosedMax: l.asked}
		if err := b.quiesce(); err != nil {
			return nil, err
		}
		if row.Handled, err = b.loadHandled(l.name, l.pub); err != nil {
			return nil, fmt.Errorf("publish to handled at %.0f msgs/s: %w", l.pub, err)
		}
		if err := b.quiesce(); err != nil {
			return nil, err
		}
		if row.Request, err = b.loadRequests(l.name, l.req); err != nil {
			return nil, fmt.Errorf("requests at %.0f req/s: %w", l.req, err)
		}
		rows = append(rows, row)
	}
	return rows, nil
}

// quiesce waits until the entities handle nothing more (for 200 ms) and,
// in durable delivery, the type's stream holds at most a message per
// shard, handled and not yet acknowledged: a load must not
// queue behind the previous one's leftovers (requests that timed out stay
// in the stream and are handled later).
func (b *bench) quiesce() error {
	b.prog.note("waiting for the entities to handle what is left")
	deadline := time.Now().Add(time.Minute)
	last, lastAt := int64(-1), time.Now()
	for {
		n := b.tally.handled.n.Load()
		if n != last {
			last, lastAt = n, time.Now()
		}
		if time.Since(lastAt) >= 200*time.Millisecond {
			left, err := b.streamMessages()
			if err != nil {
				return err
			}
			// A shard's owner acknowledges its last message handled only
			// when it handles the next (docs/PROTOCOL.md, "Durable
			// delivery"): one per shard may stay.
			if left <= uint64(b.cfg.Shards) {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the entities still handle messages after a minute")
		}
		if !wait.Sleep(b.ctx, 20*time.Millisecond) {
			return b.ctx.Err()
		}
	}
}

// streamMessages is how many messages the type's stream holds (0 in core
// delivery).
func (b *bench) streamMessages() (uint64, error) {
	if !b.durable() {
		return 0, nil
	}
	ctx, cancel := context.WithTimeout(b.ctx, b.cfg.Timeout)
	defer cancel()
	var n uint64
	for _, name := range b.msgStreams { // found once, by openRawStream
		st, err := b.sys.js.Stream(ctx, name)
		if err != nil {
			return 0, fmt.Errorf("the message stream %s: %w", name, err)
		}
		n += st.CachedInfo().State.Msgs
	}
	return n, nil
}

// pace calls send(i) for i = 0, 1, ... at rate per second (a batch every
// millisecond) until it sent rate times the load's seconds, and returns
// how long that took: longer when send cannot keep up.
func (b *bench) pace(rate float64, send func(i int) error) (time.Duration, error) {
	total := int(rate * b.cfg.LoadSeconds)
	start := time.Now()
	for n := 0; n < total; {
		for due := min(total, int(rate*time.Since(start).Seconds())); n < due; n++ {
			if err := send(n); err != nil {
				return 0, err
			}
		}
		if b.ctx.Err() != nil {
			return 0, b.ctx.Err()
		}
		time.Sleep(time.Millisecond)
	}
	return time.Since(start), nil
}

// loadHandled publishes at rate and takes each message's time from its
// publish to its handling.
func (b *bench) loadHandled(load string, rate float64) (LatencyPoint, error) {
	h := &latHist{}
	b.tally.loadHist.Store(h)
	defer b.tally.loadHist.Store(nil)
	b.prog.note("latency at %s load: publish to handled, %.0f msgs/s for %.0f s", load, rate, b.cfg.LoadSeconds)
	// Each publisher paces its share, as the throughput rounds share the
	// messages among them.
	var errs atomic.Int64
	var took time.Duration
	var tookMu sync.Mutex
	var pacers sync.WaitGroup
	perr := make(chan error, len(b.pubs))
	start := time.Now()
	for p, nc := range b.pubs {
		pacers.Go(func() {
			t, err := b.pace(rate/float64(len(b.pubs)), func(i int) error {
				m := &nats.Msg{Subject: b.natSubj[(i*len(b.pubs)+p)%len(b.natSubj)], Data: b.payload, Header: nats.Header{}}
				m.Header.Set(benchSentHeader, strconv.FormatInt(since0(), 10))
				if !b.durable() {
					return nc.PublishMsg(m)
				}
				for {
					_, err := b.pubJS[p].PublishMsgAsync(m)
					if !errors.Is(err, jetstream.ErrTooManyStalledMsgs) {
						if err != nil {
							errs.Add(1)
						}
						return nil
					}
					// Too many unacknowledged: the stream is behind, this
					// load goes no faster.
					if b.ctx.Err() != nil {
						return b.ctx.Err()
					}
				}
			})
			if err == nil {
				err = b.sent(p)
			}
			perr <- err
			tookMu.Lock()
			took = max(took, t)
			tookMu.Unlock()
		})
	}
	pacers.Wait()
	close(perr)
	for err := range perr {
		if err != nil {
			return LatencyPoint{}, err
		}
	}
	// Every message published is handled, or, in core delivery, dropped
	// by the server (a region too slow for it): those count as errors
	// once no more are handled for --timeout. A durable message is never
	// dropped: none handled for --timeout fails the run.
	sent := int64(len(b.pubs)) * int64(rate/float64(len(b.pubs))*b.cfg.LoadSeconds)
	last, lastAt := int64(-1), time.Now()
	for {
		if n := h.count.Load(); n != last {
			last, lastAt = n, time.Now()
		}
		if last+errs.Load() >= sent {
			break
		}
		if time.Since(lastAt) > b.cfg.Timeout {
			if b.durable() {
				return LatencyPoint{}, fmt.Errorf("%d of %d messages handled, none for %v", last, sent, b.cfg.Timeout)
			}
			errs.Store(sent - last)
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	p := h.point(took, errs.Load())
	p.Handled = float64(last) / lastAt.Sub(start).Seconds()
	return p, nil
}

// loadRequests sends requests at rate through natshard.Client and times
// each from the call to its answer.
func (b *bench) loadRequests(load string, rate float64) (LatencyPoint, error) {
	b.prog.note("latency at %s load: requests, %.0f req/s for %.0f s", load, rate, b.cfg.LoadSeconds)
	client, err := b.client()
	if err != nil {
		return LatencyPoint{}, err
	}
	h := &latHist{}
	var errs atomic.Int64
	var calls sync.WaitGroup
	took, err := b.pace(rate, func(i int) error {
		calls.Go(func() {
			ctx, cancel := context.WithTimeout(b.ctx, b.cfg.Timeout)
			defer cancel()
			t0 := time.Now()
			if _, err := client.Request(ctx, b.sys.cfg.Type, b.ids[i%len(b.ids)], b.payload); err != nil {
				errs.Add(1)
				return
			}
			h.add(time.Since(t0))
		})
		return nil
	})
	calls.Wait()
	if err != nil {
		return LatencyPoint{}, err
	}
	return h.point(took, errs.Load()), nil
}

// client is a natshard.Client on the requester's connection that knows
// the bench type.
func (b *bench) client() (*natshard.Client, error) {
	opts := []natshard.ClientOption{natshard.WithTimeout(b.cfg.Timeout)}
	if b.cfg.DataPrefix != "" {
		opts = append(opts, natshard.WithPrefix(b.cfg.DataPrefix))
	}
	client := natshard.NewClient(b.requester, opts...)
	if _, err := client.Request(b.ctx, b.sys.cfg.Type, b.ids[0], b.payload); err != nil { // learns the type
		return nil, err
	}
	return client, nil
}

// requestMax runs loadCallers callers, each sending its next request
// when the last is answered, for --load-seconds, and returns the
// answers per second.
func (b *bench) requestMax() (float64, error) {
	b.prog.note("maximum request rate: %d callers for %.0f s", loadCallers, b.cfg.LoadSeconds)
	client, err := b.client()
	if err != nil {
		return 0, err
	}
	end := time.Now().Add(time.Duration(b.cfg.LoadSeconds * float64(time.Second)))
	var answered, next atomic.Int64
	var callers sync.WaitGroup
	errs := make(chan error, loadCallers)
	for range loadCallers {
		callers.Go(func() {
			for time.Now().Before(end) && b.ctx.Err() == nil {
				i := next.Add(1)
				ctx, cancel := context.WithTimeout(b.ctx, b.cfg.Timeout)
				_, err := client.Request(ctx, b.sys.cfg.Type, b.ids[int(i)%len(b.ids)], b.payload)
				cancel()
				if err != nil {
					errs <- err
					return
				}
				answered.Add(1)
			}
		})
	}
	callers.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return 0, err
	}
	return float64(answered.Load()) / b.cfg.LoadSeconds, nil
}

// latHist is a histogram of durations safe for concurrent use: 32
// buckets per power of two (about 3 % wide).
type latHist struct {
	count   atomic.Int64
	buckets [64 * 32]atomic.Int64
}

func histIndex(ns uint64) int {
	e := bits.Len64(ns)
	if e <= 5 {
		return int(ns)
	}
	return (e-5)*32 + int(ns>>(e-6)&31)
}

// histValue is the lowest duration of bucket i.
func histValue(i int) time.Duration {
	if i < 32 {
		return time.Duration(i)
	}
	e := i/32 + 5
	return time.Duration((32 | uint64(i%32)) << (e - 6))
}

func (h *latHist) add(d time.Duration) {
	if d < 0 {
		d = 0
	}
	h.buckets[histIndex(uint64(d))].Add(1)
	h.count.Add(1)
}

// quantile is the lowest duration of the bucket that holds the q-quantile.
func (h *latHist) quantile(q float64) time.Duration {
	n := h.count.Load()
	want := int64(q*float64(n) + 0.999999)
	var seen int64
	for i := range h.buckets {
		if seen += h.buckets[i].Load(); seen >= max(want, 1) {
			return histValue(i)
		}
	}
	return 0
}

// point is h's percentiles; its rate is the samples over took, the time
// taken to send them.
func (h *latHist) point(took time.Duration, errs int64) LatencyPoint {
	us := func(q float64) float64 { return float64(h.quantile(q)) / 1e3 }
	n := h.count.Load()
	return LatencyPoint{Rate: float64(n) / took.Seconds(), Count: n, Errors: errs, P50US: us(0.5), P90US: us(0.9), P99US: us(0.99)}
}

// noteLoad records m's time from its publish, if it is a load message.
func (t *tally) noteLoad(m *natshard.Message) {
	h := t.loadHist.Load()
	if h == nil {
		return
	}
	sent, err := strconv.ParseInt(m.Header.Get(benchSentHeader), 10, 64)
	if err != nil {
		return
	}
	h.add(time.Duration(since0() - sent))
}
