package region

import (
	"math"
	"sync/atomic"
	"time"

	"github.com/natshard/natshard/protocol"
)

// Load reports. The host counts the messages it queues for each shard's
// entities (live, replayed and held ones alike). The agent turns those
// counts into message rates when it is asked (a probe of the coordinator,
// every 500 ms; a query), sampling the counters at most once per
// rateEvery and averaging the per-sample rates exponentially with time
// constant rateTau. A shard's rate is measured from its second sample on,
// so between one and two seconds after the region bound it; until then
// probe answers leave the shard out, and the coordinator keeps the load it
// last knew for it (from its previous owner).
const (
	rateEvery = time.Second
	rateTau   = 5 * time.Second
)

// loadMeter holds the sampled counters and the averaged rates: a sample,
// never changed, replaced by the next (compare-and-swap: of two callers
// due at once, one samples; the probe and a query may ask together).
type loadMeter struct {
	last atomic.Pointer[loadSample]
}

type loadSample struct {
	at     time.Time
	shards map[int]shardRate
}

type shardRate struct {
	delivered uint64  // the host's counter at the sample
	rate      float64 // messages per second, averaged
	measured  bool    // rate holds a measurement (two samples were taken)
}

// sample brings the rates of the shards in held up to date if a sample is
// due at now, reading each shard's counter with count, and forgets the
// shards not in held. A counter that went down (the shard was stopped and
// bound again, so the host started it afresh) counts from zero.
func (lm *loadMeter) sample(now time.Time, held []int, count func(shard int) uint64) {
	old := lm.last.Load()
	if old != nil && now.Sub(old.at) < rateEvery {
		return
	}
	next := &loadSample{at: now, shards: make(map[int]shardRate, len(held))}
	for _, sh := range held {
		n := count(sh)
		r, ok := shardRate{}, false
		if old != nil {
			r, ok = old.shards[sh]
		}
		if !ok {
			next.shards[sh] = shardRate{delivered: n}
			continue
		}
		dt := now.Sub(old.at).Seconds()
		d := n
		if n >= r.delivered {
			d = n - r.delivered
		}
		inst := float64(d) / dt
		if r.measured {
			r.rate += (1 - math.Exp(-dt/rateTau.Seconds())) * (inst - r.rate)
		} else {
			r.rate, r.measured = inst, true
		}
		r.delivered = n
		next.shards[sh] = r
	}
	lm.last.CompareAndSwap(old, next)
}

// rate returns shard's averaged rate and whether it is measured.
func (lm *loadMeter) rate(shard int) (float64, bool) {
	if s := lm.last.Load(); s != nil {
		if r := s.shards[shard]; r.measured {
			return r.rate, true
		}
	}
	return 0, false
}

// loads samples the meter for the shards in held (all the shards the
// region holds: the meter forgets the others) and returns their loads
// and whether each rate is measured.
func (a *Agent) loads(held []int) ([]protocol.ShardLoad, []bool) {
	a.meter.sample(time.Now(), held, func(sh int) uint64 { n, _ := a.host.ShardLoad(sh); return n })
	loads := make([]protocol.ShardLoad, len(held))
	measured := make([]bool, len(held))
	for i, sh := range held {
		_, entities := a.host.ShardLoad(sh)
		rate, ok := a.meter.rate(sh)
		loads[i] = protocol.ShardLoad{Shard: sh, Rate: rate, Entities: entities}
		measured[i] = ok
	}
	return loads, measured
}
