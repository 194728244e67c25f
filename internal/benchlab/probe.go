package benchlab

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/entities"
)

// clock0 is the origin of the probes' timestamps.
var clock0 = time.Now()

func since0() int64 { return int64(time.Since(clock0)) }

// tally counts what the entities of every region of a system handle, and
// holds each region's probe.
type tally struct {
	// handled counts every message handled by an entity of any region.
	handled recvCounter
	// loadHist, while set, gets the time of each load message from its
	// publish to its handling (loadlat.go).
	loadHist atomic.Pointer[latHist]
	failed   atomic.Int64 // of those, the ones Handle returned an error for

	mu     sync.Mutex
	probes map[string]*benchProbe // by region
}

// entity is SystemConfig.Entity: entities of kind, behind the tally.
func (t *tally) entity(kind string) func(region string) (natshard.Factory, error) {
	return func(region string) (natshard.Factory, error) {
		inner, err := entities.Kind(kind, "")
		if err != nil {
			return nil, err
		}
		p := t.probe(region)
		return func(ctx context.Context, eid string) (natshard.Entity, error) {
			e, err := inner(ctx, eid)
			if err != nil {
				return nil, err
			}
			pe := &probed{inner: e, tally: t, probe: p}
			if f, ok := e.(natshard.Flusher); ok {
				return &probedFlusher{probed: pe, flusher: f}, nil
			}
			return pe, nil
		}, nil
	}
}

// probe is region's probe.
func (t *tally) probe(region string) *benchProbe {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.probes == nil {
		t.probes = map[string]*benchProbe{}
	}
	p := t.probes[region]
	if p == nil {
		p = &benchProbe{}
		t.probes[region] = p
	}
	return p
}

// benchProbe notes the first message of one shard that a region handles
// once armed: the new owner's first message in a handoff.
type benchProbe struct {
	armed atomic.Bool
	shard atomic.Int64
	first atomic.Int64 // since0() of that message
	ch    atomic.Pointer[chan struct{}]
}

func (p *benchProbe) arm(shard int) <-chan struct{} {
	ch := make(chan struct{})
	p.shard.Store(int64(shard))
	p.ch.Store(&ch)
	p.armed.Store(true)
	return ch
}

// probed wraps an entity: it counts what it handles and feeds the probe.
type probed struct {
	inner natshard.Entity
	tally *tally
	probe *benchProbe
	// unflushed counts the messages handled since the last Flush of a
	// Flusher (probedFlusher): they count as handled once stored.
	unflushed int
}

// probedFlusher is probed around a natshard.Flusher (the kv kind): it
// passes Flush on, and counts a message handled once Flush stored it.
type probedFlusher struct {
	*probed
	flusher natshard.Flusher
}

func (e *probedFlusher) Flush(ctx context.Context) error {
	n := e.unflushed
	e.unflushed = 0
	if err := e.flusher.Flush(ctx); err != nil {
		return err // handled again, and counted then
	}
	for range n {
		e.tally.handled.add()
	}
	return nil
}

func (e *probed) Handle(ctx context.Context, m *natshard.Message) ([]byte, error) {
	data, err := e.inner.Handle(ctx, m)
	if err != nil {
		e.tally.failed.Add(1)
	}
	e.tally.noteLoad(m)
	if natshard.WillFlush(ctx) {
		e.unflushed++
	} else {
		e.tally.handled.add()
	}
	if p := e.probe; p.armed.Load() && int64(m.Shard) == p.shard.Load() && p.armed.CompareAndSwap(true, false) {
		p.first.Store(since0())
		close(*p.ch.Load())
	}
	return data, err
}

func (e *probed) Stop(ctx context.Context) error { return e.inner.Stop(ctx) }
