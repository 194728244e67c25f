package coordinator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/renewal"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// This file holds a term of leadership: the leader's loop over events,
// ticks and the lease's renewals, the state a term starts from, and the
// renewal of the lease between the batches of writes.

// leader is one term of leadership: from taking the lease to losing or
// releasing it. Only its run goroutine touches core and lease.
type leader struct {
	*Node
	info      protocol.CoordinatorInfo
	lease     kvstate.Lease
	renewedAt time.Time        // when the last successful renewal was sent
	clock     func() time.Time // tests: the time renewIfDue sees, when set
	core      *Core
	events    chan Event // command outcomes, unparks and marks, from other goroutines
	admin     chan *nats.Msg
	seen      map[string]protocol.RegionInfo // regions as last announced on the events subject
	removed   map[string]bool                // regions whose registration this leader removed (found dead), until announced gone
	roundAt   time.Time                      // when the current rebalance round was planned
	splitAt   time.Time                      // when this term recorded the split under way
	track     *moveTracker
}

var errStepDown = errors.New("coordinator: stepping down")

func (l *leader) run(parent context.Context) {
	ctx, cancel := context.WithCancel(parent)
	defer cancel()
	err := l.lead(ctx)
	if parent.Err() == nil {
		l.log.Warn("lost or gave up the coordinator lease", "epoch", l.info.Epoch, "err", err)
	}
	// Release the lease if it is still ours, so that another candidate
	// takes over at once instead of after the TTL.
	rctx, rcancel := context.WithTimeout(context.WithoutCancel(parent), 2*time.Second)
	defer rcancel()
	if err := l.cfg.Store.Release(rctx, l.lease); err == nil {
		l.log.Info("released the coordinator lease", "epoch", l.info.Epoch)
	}
}

func (l *leader) lead(ctx context.Context) error {
	epoch := l.info.Epoch
	renew := time.NewTimer(renewal.Wait(l.renewedAt, l.cfg.LeaseTTL, false, time.Now()))
	defer renew.Stop()
	start, err := l.readStart(ctx, renew)
	if err != nil {
		return err
	}
	table, regions, pins := start.table, start.regions, start.pins
	if start.config.Shards == 0 {
		start.config.Shards = l.cfg.Shards // a bucket without configuration (tests)
	}
	ticks := func(d time.Duration) int { return max(1, int(d/l.cfg.Tick)) }
	rebalance, settle := -1, -1
	if l.cfg.RebalanceInterval > 0 {
		rebalance = ticks(l.cfg.RebalanceInterval)
	}
	if l.cfg.Settle > 0 {
		settle = ticks(l.cfg.Settle)
	}
	core, acts := NewCore(CoreConfig{
		Shards: l.cfg.Shards, TypeConfig: start.config, Strategy: l.cfg.Strategy, MinRegions: l.cfg.MinRegions,
		ProbeEvery: ticks(l.cfg.ProbeInterval), Retry: ticks(time.Second),
		HandOffTimeout: ticks(l.cfg.HandOffTimeout), RebalanceEvery: rebalance, Settle: settle, MaxMoves: l.cfg.MaxMoves,
		Pins: pins, Stats: l.cfg.Stats,
	}, l.cfg.Region, epoch, table, regions)
	l.core = core
	l.parker.setLayout(core.Layout())
	l.track = newMoveTracker(l.cfg.Stats, l.cfg.OnMove, core.Layout().Shards(), table)
	defer l.track.stop()
	l.events = make(chan Event, 1024)
	l.admin = make(chan *nats.Msg, 16)
	ids := make([]string, len(regions))
	for i, r := range regions {
		ids[i] = r.Info.ID
	}
	l.log.Info("leading", "epoch", epoch, "regions", ids, "rows", len(table), "pins", len(pins), "shards", core.Layout().Shards())
	if to := core.Splitting(); to != 0 {
		l.log.Info("a split recorded by a previous term is under way: the missing rows are written, every region is asked to split", "from", start.config.Shards, "to", to)
	}
	l.seen, l.removed = map[string]protocol.RegionInfo{}, map[string]bool{}
	for _, r := range core.Regions() {
		l.seen[r.Info.ID] = r.Info
	}
	l.publish(protocol.Event{Kind: protocol.EventCoordinator, Region: l.cfg.Region})

	adminSub, err := l.cfg.Conn.ChanSubscribe(l.cfg.Subjects.AdminAll(), l.admin)
	if err != nil {
		return fmt.Errorf("subscribe admin API: %w", err)
	}
	defer adminSub.Unsubscribe()

	if err := l.execute(ctx, acts); err != nil {
		return err
	}
	// The parkings of this candidate's previous term that this one has
	// not adopted: once every region has answered its first probe (or
	// failed to), those of shards found without owner are adopted; the
	// others go. (Parkings are the term's by its epoch.)
	adopt := time.NewTimer(l.cfg.CommandTimeout + l.cfg.Tick)
	defer adopt.Stop()
	watch := l.watchRegions(ctx)
	tick := time.NewTicker(l.cfg.Tick)
	defer tick.Stop()
	reconnects := l.cfg.Conn.Stats().Reconnects
	for {
		var acts []Action
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-renew.C:
			if err := l.renewOn(ctx, renew); err != nil {
				return err
			}
		case ev, ok := <-watch:
			if !ok {
				watch = l.watchRegions(ctx)
				continue
			}
			acts = core.Step(ev)
		case ev := <-l.events:
			acts = core.Step(ev)
			acts = l.stepQueued(core, acts)
		case <-adopt.C:
			if shards := l.parker.releaseOthers(epoch); len(shards) > 0 {
				l.log.Info("stopped parking shards that a previous term parked and this one found owned", "shards", shards)
			}
		case <-tick.C:
			if r := l.cfg.Conn.Stats().Reconnects; r != reconnects {
				// Back from a reconnect: if a candidate deposed this
				// coordinator meanwhile (its probes found no responders),
				// learn it now rather than at the next renewal.
				reconnects = r
				renew.Reset(0)
			}
			acts = core.Tick()
		case c := <-l.closed:
			acts = core.Step(ConnClosed(c))
		case m := <-l.admin:
			if err := l.answerAdmin(ctx, m); err != nil {
				return err
			}
		}
		l.announceRegions(acts) // before the moves that a change of regions starts
		if err := l.execute(ctx, acts); err != nil {
			return err
		}
	}
}

// startState is what a term starts from, read from the bucket once the
// lease is taken (so that no earlier term can change it after: the
// table's writes are fenced by the lease).
type startState struct {
	config  protocol.TypeConfig // zero when the bucket has none
	table   []protocol.ShardRecord
	regions []RegionSeen
	pins    map[int]string
	err     error
}

// readStart reads the term's startState, renewing the lease meanwhile
// when renew (the term's renewal timer) fires.
// The reads (KV snapshots of the table, the regions and the pins) took 2
// to 5 s on a loaded machine (two fault tests beside the region's race
// tests), longer than a 4 s lease lets its holder go without renewing (3
// s, renewal.Deadline): each term stepped down as it began to lead, and
// the next one read again (docs/faults-log/2026-11-28-coordinator-terms-under-load.md).
func (l *leader) readStart(ctx context.Context, renew *time.Timer) (startState, error) {
	rctx, cancel := context.WithCancel(ctx)
	defer cancel() // ends the reads of a term that steps down meanwhile
	read := make(chan startState, 1)
	go func() { read <- readState(rctx, l.cfg.Store, l.startHook) }()
	for {
		select {
		case s := <-read:
			return s, s.err
		case <-renew.C:
			if err := l.renewOn(ctx, renew); err != nil {
				return startState{}, err
			}
		}
	}
}

// readState reads a term's startState from store; hook, when set (by
// tests), runs first.
func readState(ctx context.Context, store *kvstate.Store, hook func(context.Context)) (s startState) {
	if hook != nil {
		hook(ctx)
	}
	// The configuration before the table: a split's commit is written
	// before its rows, so a table read after a configuration without the
	// split holds none of them.
	if s.config, s.err = store.Config(ctx); s.err != nil && !errors.Is(s.err, kvstate.ErrNotFound) {
		s.err = fmt.Errorf("read the type's configuration: %w", s.err)
		return s
	}
	s.err = nil
	if s.table, s.err = store.Shards(ctx); s.err != nil {
		s.err = fmt.Errorf("read shard table: %w", s.err)
		return s
	}
	entries, err := store.Regions(ctx)
	if err != nil {
		s.err = fmt.Errorf("read regions: %w", err)
		return s
	}
	s.regions = make([]RegionSeen, len(entries))
	for i, e := range entries {
		s.regions[i] = RegionSeen{Info: e.Info, Revision: e.Revision}
	}
	if s.regions, s.err = confirmOwners(ctx, store.Region, s.table, s.regions); s.err != nil {
		s.err = fmt.Errorf("read regions: %w", s.err)
		return s
	}
	if s.pins, s.err = store.Pins(ctx); s.err != nil {
		s.err = fmt.Errorf("read pins: %w", s.err)
	}
	return s
}

// confirmOwners reads from the stream leader (region) the registration of
// every region that a row names as owner or source but regions, the
// listing, does not hold with the row's incarnation, and takes what the
// leader holds instead. The takeover re-homes the shards of a region it
// does not find live, so a listing short of a live region would give its
// shards a second owner while it serves them: core seed 50 of the campaign
// saw one, before kvstate's listings waited for every key the leader holds
// (docs/FAULTS.md); a replica rebuilding its store may still hold a key's
// older value (kvstate's snapshot). Usually no row needs a read: only
// rows of regions that are gone.
func confirmOwners(ctx context.Context, region func(context.Context, string) (protocol.RegionInfo, uint64, error), table []protocol.ShardRecord, regions []RegionSeen) ([]RegionSeen, error) {
	listed := make(map[string]int, len(regions))
	for i, r := range regions {
		listed[r.Info.ID] = i
	}
	checked := map[string]bool{}
	for _, rec := range table {
		for _, owner := range [][2]string{{rec.Region, rec.Incarnation}, {rec.Source, rec.SourceIncarnation}} {
			id, inc := owner[0], owner[1]
			if i, ok := listed[id]; id == "" || checked[id] || ok && regions[i].Info.Incarnation == inc {
				continue
			}
			checked[id] = true
			info, rev, err := region(ctx, id)
			switch {
			case errors.Is(err, kvstate.ErrNotFound), errors.Is(err, kvstate.ErrMalformed):
				continue // gone, or left out as the listing leaves it out
			case err != nil:
				return nil, fmt.Errorf("read the registration of %s: %w", id, err)
			case info.ID != id:
				continue
			}
			seen := RegionSeen{Info: info, Revision: rev}
			if i, ok := listed[id]; ok {
				if rev > regions[i].Revision {
					regions[i] = seen
				}
				continue
			}
			listed[id] = len(regions)
			regions = append(regions, seen)
		}
	}
	slices.SortFunc(regions, func(a, b RegionSeen) int { return strings.Compare(a.Info.ID, b.Info.ID) })
	return regions, nil
}

// stepQueued steps the events queued behind the one that gave acts, up
// to queuedSteps of them, and returns all their actions: executed
// together, their table writes go as one batch (the activations that the
// unparker reports one shard at a time, the bound shards a region's
// answer names). The core decides as it would have; only the writes wait
// for the steps.
func (l *leader) stepQueued(core *Core, acts []Action) []Action {
	for range queuedSteps {
		select {
		case ev := <-l.events:
			acts = append(acts, core.Step(ev)...)
		default:
			return acts
		}
	}
	return acts
}

// queuedSteps bounds the events stepped before their actions run: the
// lease's renewal waits for them.
const queuedSteps = 1024

// renew extends the lease and reports whether it did. A lost lease ends
// the term at once (the error); an unreachable server ends it when the
// lease may have expired (package renewal).
func (l *leader) renew(ctx context.Context) (bool, error) {
	sent := time.Now()
	stepDownAt := renewal.Deadline(l.renewedAt, l.cfg.LeaseTTL)
	rctx, cancel := context.WithDeadline(ctx, renewal.AttemptDeadline(l.renewedAt, sent, l.cfg.LeaseTTL))
	lease, err := l.cfg.Store.Renew(rctx, l.lease, l.info)
	cancel()
	if err == nil {
		l.lease, l.renewedAt = lease, sent
		return true, nil
	}
	l.cfg.Stats.RenewalsFailed.Add(1)
	if errors.Is(err, kvstate.ErrConflict) {
		return false, fmt.Errorf("%w: lease lost: %w", errStepDown, err)
	}
	if !time.Now().Before(stepDownAt) {
		return false, fmt.Errorf("%w: cannot renew the lease in time: %w", errStepDown, err)
	}
	l.log.Warn("lease renewal failed; will retry", "err", err)
	return false, nil
}

// renewOn renews the lease when the term's renewal timer t fired, and
// sets t for the next renewal (sooner after a failed attempt).
func (l *leader) renewOn(ctx context.Context, t *time.Timer) error {
	renewed, err := l.renew(ctx)
	if err == nil {
		t.Reset(renewal.Wait(l.renewedAt, l.cfg.LeaseTTL, !renewed, time.Now()))
	}
	return err
}

// renewIfDue renews the lease when its renewal is due. The loop that
// renews also carries out the table writes, batch after batch (row
// after row where they go one at a time: writeShards), and a
// first allocation of many shards (3 writes each; one after another,
// 4 096 shards took longer than the lease before the batches) can take
// longer than the lease: without this its writes would be refused as
// fenced halfway, and the next term would start over
// (docs/bench-log/scaling.md, the coordinator).
func (l *leader) renewIfDue(ctx context.Context) error {
	now := time.Now()
	if l.clock != nil {
		now = l.clock()
	}
	if renewal.Wait(l.renewedAt, l.cfg.LeaseTTL, false, now) > 0 {
		return nil
	}
	_, err := l.renew(ctx)
	return err
}
