package benchlab

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

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

// Touch sends body as a request to each subject on nc (64 in flight,
// each waiting up to timeout), retrying failures for a while (a shard may
// be moving), so that every entity is active.
func Touch(nc *nats.Conn, subjects []string, body []byte, timeout time.Duration) error {
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
					if m, err = nc.Request(subj, body, timeout); err == nil && m.Header.Get(protocol.HeaderError) != "" {
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
func (b *bench) handoff() (*HandoffResult, error) {
	st, err := b.sys.Status()
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
	res := &HandoffResult{Entities: b.cfg.HandoffEntities, Moves: b.cfg.Moves, Rate: b.cfg.Rate}
	var samples []time.Duration
	var moved atomic.Int64 // for the progress bar
	b.prog.phase("handoffs", int64(b.cfg.Moves), moved.Load)
	defer b.prog.clear()
	for range b.cfg.Moves {
		if err := Touch(b.requester, subjects, b.reqBody, b.cfg.Timeout); err != nil {
			return nil, err
		}
		ids := b.sys.RegionIDs()
		target := ids[(slices.Index(ids, owner)+1)%len(ids)]
		first := b.tally.probe(target).arm(shard)
		t0 := since0()
		if err := b.sys.Admin(protocol.AdminMove, protocol.MoveRequest{Shard: shard, Region: target}); err != nil {
			return nil, err
		}
		select {
		case <-first:
		case <-time.After(30 * time.Second):
			return nil, fmt.Errorf("shard %d: region %s handled no message of it 30 s after the move to it", shard, target)
		case <-b.ctx.Done():
			return nil, b.ctx.Err()
		}
		d := time.Duration(b.tally.probe(target).first.Load() - t0)
		samples = append(samples, d)
		res.Samples = append(res.Samples, Millis(d))
		if err := b.waitOwner(shard, target); err != nil {
			return nil, err
		}
		moved.Add(1)
		owner = target
	}
	slices.Sort(samples)
	res.P50MS, res.P99MS, res.MaxMS = Millis(Percentile(samples, 0.5)), Millis(Percentile(samples, 0.99)), Millis(Percentile(samples, 1))
	return res, nil
}

// waitOwner waits until shard is active on target and served live.
func (b *bench) waitOwner(shard int, target string) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		st, err := b.sys.Status()
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
func (b *bench) failover() (*FailoverResult, error) {
	stop := b.background(b.natSubj, b.cfg.Rate)
	defer stop()
	res := &FailoverResult{Kills: b.cfg.Kills, Rate: b.cfg.Rate}
	var parked, rehomed []time.Duration
	var killed atomic.Int64 // for the progress bar
	b.prog.phase("region crashes", int64(b.cfg.Kills), killed.Load)
	defer b.prog.clear()
	for range b.cfg.Kills {
		st, err := b.sys.Status()
		if err != nil {
			return nil, err
		}
		ids := b.sys.RegionIDs()
		victim := ids[len(ids)-1]
		shards := owners(st)[victim]
		t0 := time.Now()
		b.sys.Crash(victim)
		var parkedAt time.Duration
		for {
			st, err := b.sys.Status()
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
		res.Rehomed = append(res.Rehomed, Millis(d))
		if _, err := b.sys.StartRegion(b.ctx, ""); err != nil {
			return nil, err
		}
		if _, err := b.sys.WaitBalanced(b.ctx, 60*time.Second); err != nil {
			return nil, err
		}
		killed.Add(1)
	}
	var took []time.Duration
	for range b.cfg.Kills {
		d, err := b.sys.CrashCoordinator(b.ctx)
		if err != nil {
			return nil, err
		}
		took = append(took, d)
		res.Coordinator = append(res.Coordinator, Millis(d))
	}
	slices.Sort(took)
	res.CoordinatorP50MS, res.CoordinatorMaxMS = Millis(Percentile(took, 0.5)), Millis(Percentile(took, 1))
	slices.Sort(parked)
	slices.Sort(rehomed)
	res.ParkedP50MS, res.ParkedMaxMS = Millis(Percentile(parked, 0.5)), Millis(Percentile(parked, 1))
	res.RehomedP50MS, res.RehomedP99MS, res.RehomedMaxMS = Millis(Percentile(rehomed, 0.5)), Millis(Percentile(rehomed, 0.99)), Millis(Percentile(rehomed, 1))
	return res, nil
}
