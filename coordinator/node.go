package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nuid"
	"github.com/natshard/natshard/internal/renewal"
	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/strategies"
)

// Defaults of Config.
const (
	DefaultLeaseTTL       = 4 * time.Second
	DefaultTick           = 100 * time.Millisecond
	DefaultCommandTimeout = 2 * time.Second
	DefaultHandOffTimeout = 10 * time.Second
	// DefaultProbeInterval: how often every region is probed.
	DefaultProbeInterval = 500 * time.Millisecond
	// DefaultRebalanceInterval: between the starts of two strategy
	// rounds. A round's moves do not wait for it: they start as earlier
	// ones end, within DefaultMaxMoves.
	DefaultRebalanceInterval = 2 * time.Second
	// DefaultSettle: how long membership must be unchanged before a round
	// (Akka: no rebalance while members join or leave). Short, because
	// moves are cheap: regions started a second or two apart cost a round
	// each, of a fraction of a second, rather than a wait.
	DefaultSettle = time.Second
	// DefaultMaxMoves: moves of live shards in flight at once. A handoff
	// costs milliseconds (a second on a cluster, the release grace), so
	// this bounds the burst on JetStream and how many shards pause at
	// once, not the pace of a rebalance.
	DefaultMaxMoves     = 64
	DefaultReleaseGrace = time.Second
	// DefaultHolderProbe: how often a candidate probes the lease holder
	// (see Config.HolderProbe).
	DefaultHolderProbe = 200 * time.Millisecond
	// DefaultHolderSilence: how long the holder's probe subject must have
	// had no responders, probe after probe, before a candidate deposes it
	// (see Config.HolderSilence). Longer than a client's reconnect to
	// another server of a cluster (milliseconds).
	DefaultHolderSilence = 300 * time.Millisecond
)

// Config configures a Node.
type Config struct {
	Conn   *nats.Conn
	Store  *kvstate.Store
	Buffer *kvstate.Buffer // where parked shards' messages wait
	// Durable: the type's messages wait in its stream (durable delivery):
	// parking a shard needs no subscription, and no move needs an end
	// marker.
	Durable  bool
	Subjects protocol.Subjects
	Shards   int
	// Region is the id of the process this candidate runs in (for display).
	Region     string
	Strategy   strategies.Strategy // default least-shard with the default limits
	MinRegions int
	// LeaseTTL of the coordinator lease; renewed every LeaseTTL/4 or
	// every second, whichever is sooner (renewal.Interval).
	LeaseTTL       time.Duration
	Tick           time.Duration // one core tick
	CommandTimeout time.Duration // bound on each command to a region
	// HandOffTimeout: how long a source may take to pause a shard.
	HandOffTimeout time.Duration
	// ProbeInterval between probes of each region (DefaultProbeInterval).
	ProbeInterval time.Duration
	// RebalanceInterval between the starts of strategy rounds; negative
	// disables them.
	RebalanceInterval time.Duration
	// Settle: membership must be unchanged this long before a strategy
	// round runs; 0 means DefaultSettle, negative none.
	Settle       time.Duration
	MaxMoves     int           // moves of live shards in flight
	ReleaseGrace time.Duration // unpark: keep diverting this long first; 0 means the default, negative none
	// HolderProbe: while another candidate holds the lease, probe it this
	// often on its probe subject (CoordinatorInfo.Probe); 0 means
	// DefaultHolderProbe, negative never (wait for the lease to expire).
	HolderProbe time.Duration
	// HolderSilence: depose the holder (compare-and-delete of its lease)
	// once its probe subject has had no responders, probe after probe,
	// for this long; 0 means DefaultHolderSilence.
	HolderSilence time.Duration
	// Disconnects, if set, reports the client connections the NATS
	// servers close (DisconnectAdvisories): the leader then probes the
	// region of a closed connection at once instead of at its next probe,
	// and a candidate probes the lease holder at once. The probes stay the
	// proof; without Disconnects they find the same, later.
	Disconnects Disconnects
	Logger      *slog.Logger
	// Stats, when set, is kept up to date (stats.go); OnMove, when set,
	// is told each shard move the leader saw end, on its goroutine: it
	// must not block.
	Stats  *Stats
	OnMove func(Move)
}

func (c *Config) setDefaults() {
	if c.Strategy == nil {
		c.Strategy = strategies.NewLeastShard(strategies.DefaultAbsoluteLimit, strategies.DefaultRelativeLimit)
	}
	if c.LeaseTTL <= 0 {
		c.LeaseTTL = DefaultLeaseTTL
	}
	if c.Tick <= 0 {
		c.Tick = DefaultTick
	}
	if c.CommandTimeout <= 0 {
		c.CommandTimeout = DefaultCommandTimeout
	}
	if c.HandOffTimeout <= 0 {
		c.HandOffTimeout = DefaultHandOffTimeout
	}
	if c.ProbeInterval <= 0 {
		c.ProbeInterval = DefaultProbeInterval
	}
	if c.RebalanceInterval == 0 {
		c.RebalanceInterval = DefaultRebalanceInterval
	}
	if c.Settle == 0 {
		c.Settle = DefaultSettle
	}
	if c.MaxMoves <= 0 {
		c.MaxMoves = DefaultMaxMoves
	}
	if c.ReleaseGrace == 0 {
		c.ReleaseGrace = DefaultReleaseGrace
	}
	if c.HolderProbe == 0 {
		c.HolderProbe = DefaultHolderProbe
	}
	if c.HolderSilence <= 0 {
		c.HolderSilence = DefaultHolderSilence
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Stats == nil {
		c.Stats = &Stats{}
	}
}

// Node is a coordinator candidate. Run campaigns for the type's coordinator
// lease and, while it holds it, makes the decisions of the Core and carries
// them out over NATS. Every shardd runs one unless told not to.
type Node struct {
	cfg Config
	log *slog.Logger
	// closed: connections the servers reported closed (Config.Disconnects),
	// read by whichever of the leader or the candidate runs.
	closed chan Disconnect
	// parker diverts the shards without owner, for every term of this
	// candidate's leadership (see parker).
	parker *parker
	// own: the incarnations of the lease values this candidate wrote, or
	// may have written (an acquisition it got no answer to), the newest
	// last; read by retakeOwn.
	own []string
	// startHook, when set (by tests), runs before a term's start-up
	// reads, as slow as a loaded server makes them (readStart).
	startHook func(context.Context)
}

// ownKept bounds Node.own.
const ownKept = 4

// New returns a candidate; it does nothing until Run.
func New(cfg Config) *Node {
	cfg.setDefaults()
	n := &Node{cfg: cfg, log: cfg.Logger.With("component", "coordinator"), closed: make(chan Disconnect, 64)}
	n.parker = newParker(cfg.Conn, cfg.Buffer, cfg.Subjects, n.log, cfg.Stats)
	return n
}

// Run campaigns and leads until ctx ends; then it releases the lease if it
// holds it and returns nil. It returns an error only for a configuration it
// cannot work with.
func (n *Node) Run(ctx context.Context) error {
	if n.cfg.Conn == nil || n.cfg.Store == nil || n.cfg.Buffer == nil || n.cfg.Shards <= 0 {
		return errors.New("coordinator: Conn, Store, Buffer and Shards are required")
	}
	probes, err := n.answerProbes()
	if err != nil {
		n.log.Warn("cannot answer probes on a coordinator subject: while this candidate leads, the others wait for its lease to expire if it dies", "err", err)
	}
	defer probes.stop()
	if n.cfg.Disconnects != nil {
		unsubscribe, err := n.cfg.Disconnects.Subscribe(func(c Disconnect) {
			select {
			case n.closed <- c:
			default: // full: the probes find it anyway
			}
		})
		if err != nil {
			n.log.Warn("cannot read the servers' disconnect advisories: dead regions are found by their probes only", "err", err)
		} else {
			defer unsubscribe()
		}
	}
	holder := &silence{window: n.cfg.HolderSilence}
	for ctx.Err() == nil {
		info := protocol.CoordinatorInfo{Region: n.cfg.Region, Incarnation: nuid.Next(), Since: time.Now().UnixMilli(),
			Probe: probes.checked(ctx), Conn: protocol.ConnIDOf(n.cfg.Conn)}
		n.own = append(n.own[max(0, len(n.own)-ownKept+1):], info.Incarnation)
		sent := time.Now()
		lease, err := n.cfg.Store.AcquireCoordinator(ctx, info, n.cfg.LeaseTTL)
		switch {
		case err == nil:
			n.term(ctx, info, lease, sent)
		case errors.Is(err, kvstate.ErrConflict):
			if n.retakeOwn(ctx) {
				continue
			}
			// Another candidate leads: it parks what has no owner.
			n.stopParking("another candidate holds the coordinator lease")
			n.waitForVacancy(ctx, holder)
		default:
			n.log.Warn("cannot campaign for the coordinator lease", "err", err)
			wait.Sleep(ctx, time.Second)
		}
	}
	n.stopParking("the candidate stops")
	return nil
}

// term leads with the lease just taken, whose acquisition was sent at
// sent, until the term ends. The term's epoch is the lease's revision
// when taken (info.Epoch, which the lease's value carries from its first
// renewal on, and regions check commands against).
func (n *Node) term(ctx context.Context, info protocol.CoordinatorInfo, lease kvstate.Lease, sent time.Time) {
	n.log.Info("took the coordinator lease", "epoch", lease.Revision)
	info.Epoch = lease.Revision
	if !time.Now().Before(renewal.Deadline(sent, n.cfg.LeaseTTL)) {
		// Acknowledged so late that the rule counts the lease expired
		// already: renew it before leading (the epoch stays).
		sent = time.Now()
		var err error
		if lease, err = n.cfg.Store.Renew(ctx, lease, info); err != nil {
			n.log.Warn("took the coordinator lease too late to lead, and cannot renew it", "err", err)
			return
		}
	}
	l := &leader{Node: n, info: info, lease: lease, renewedAt: sent}
	n.cfg.Stats.Terms.Add(1)
	n.cfg.Stats.Epoch.Store(info.Epoch)
	n.cfg.Stats.Leading.Store(true)
	l.run(ctx)
	n.cfg.Stats.Leading.Store(false)
	n.cfg.Stats.Epoch.Store(0)
}

// retakeOwn is called when the lease is found held. If it holds one of
// this candidate's incarnations (n.own), it is a renewal or an acquisition
// the server stored after the candidate had stopped waiting for the
// answer, which the term's release, at the revision it knew, missed.
// retakeOwn deposes it and reports true: the candidate campaigns again at
// once and keeps its parkings for its next term to adopt. Waiting for it
// to expire left the term's parked shards without parking until then
// (nothing deposes it sooner: the candidate's own probe subject answers
// for its holder; TestStepDownWhileParked, "own lease";
// docs/faults-log/2026-11-28-own-lease.md). It
// also reports true when the lease is gone by now, and after a failed
// read or deposition (the next campaign finds out); false when another
// candidate holds it.
func (n *Node) retakeOwn(ctx context.Context) bool {
	info, rev, err := n.cfg.Store.Coordinator(ctx)
	switch {
	case errors.Is(err, kvstate.ErrNotFound):
		return true // expired or released meanwhile
	case err != nil:
		n.log.Warn("cannot read the coordinator lease", "err", err)
		wait.Sleep(ctx, time.Second)
		return true
	case !slices.Contains(n.own, info.Incarnation): // incarnations are unique (nuid)
		return false
	}
	switch err := n.cfg.Store.DeposeCoordinator(ctx, rev); {
	case err == nil:
		n.log.Info("the coordinator lease was this candidate's own, left by a term it no longer leads in (a renewal stored after the term gave up on it): deposed, to take it again", "revision", rev)
	case !errors.Is(err, kvstate.ErrConflict): // a conflict: it changed meanwhile, the next campaign sees how
		n.log.Warn("cannot depose a coordinator lease of this candidate's own, left by a term it no longer leads in", "revision", rev, "err", err)
		wait.Sleep(ctx, time.Second)
	}
	return true
}

// stopParking drains the parkings left by this candidate's last term of
// leadership (see parker).
func (n *Node) stopParking(why string) {
	if shards := n.parker.stop(); len(shards) > 0 {
		n.log.Info("stopped parking shards: the term that parked them ended", "shards", shards, "why", why)
	}
}

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
	if s.pins, s.err = store.Pins(ctx); s.err != nil {
		s.err = fmt.Errorf("read pins: %w", s.err)
	}
	return s
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

// execute carries out actions in order. Table writes are synchronous and
// fenced: a refused write ends the term. Consecutive writes go as one
// batch (writeShards, up to kvstate.MaxShardBatch), which the next action
// that may depend on them waits for (waitsForWrites). Commands run
// concurrently and report back through l.results.
func (l *leader) execute(ctx context.Context, acts []Action) error {
	var unparks []Unpark
	var writes []protocol.ShardRecord // not written yet
	// Fences are logged once per call at INFO, each shard's at DEBUG: a
	// takeover or a dead source can fence dozens of shards at once.
	var fenced, fencing []int
	defer func() {
		if len(fenced) > 0 {
			l.log.Info("fenced handoffs' sources in their shards' buffers: what they append from now on is not replayed", "shards", fenced)
		}
		if len(fencing) > 0 {
			l.log.Info("fencing the handoffs of sources that died in their shards' buffers, then writing their end markers", "shards", fencing)
		}
	}()
	flush := func() error {
		err := l.writeShards(ctx, writes)
		writes = writes[:0]
		return err
	}
	for _, a := range acts {
		if w, ok := a.(WriteShard); ok {
			// A full batch goes at once: it is as large as one can be,
			// and waitsForWrites looks through what is held.
			if len(writes) == kvstate.MaxShardBatch {
				if err := flush(); err != nil {
					return err
				}
			}
			writes = append(writes, w.Record)
			continue
		}
		if waitsForWrites(a, writes) {
			if err := flush(); err != nil {
				return err
			}
		}
		switch a := a.(type) {
		case WriteConfig:
			if err := l.renewIfDue(ctx); err != nil {
				return err
			}
			if _, err := l.cfg.Store.PutConfig(ctx, l.lease, a.Config); err != nil {
				return fmt.Errorf("%w: write the type's configuration: %w", errStepDown, err)
			}
			layout := l.core.Layout()
			l.parker.setLayout(layout)
			l.track.grow(layout.Shards())
			ev := protocol.Event{Kind: protocol.EventSplit}
			if a.Config.To != 0 {
				ev.State, ev.Shards = "committed", a.Config.To
				l.splitAt = time.Now()
				l.log.Info("split recorded: each shard's children go to its region; every region is asked to split", "from", a.Config.Shards, "to", a.Config.To)
			} else {
				ev.State, ev.Shards = "announced", a.Config.Shards
				args := []any{"shards", a.Config.Shards, "history", a.Config.History}
				if !l.splitAt.IsZero() {
					args = append(args, "took", duration(time.Since(l.splitAt)))
				}
				l.log.Info("split announced: every region split; clients use the new count", args...)
			}
			l.publish(ev)
		case WritePin:
			ev := protocol.Event{Kind: protocol.EventPin, Shard: &a.Shard, Region: a.Region}
			var err error
			if a.Region != "" {
				_, err = l.cfg.Store.PutPin(ctx, l.lease, a.Shard, a.Region)
			} else {
				err = l.cfg.Store.DeletePin(ctx, l.lease, a.Shard)
				ev.Kind = protocol.EventUnpin
			}
			if err != nil {
				return fmt.Errorf("%w: write pin of shard %d: %w", errStepDown, a.Shard, err)
			}
			l.log.Info(ev.Kind, "shard", a.Shard, "region", a.Region)
			l.publish(ev)
		case Send:
			go l.send(ctx, a)
		case RemoveRegion:
			switch err := l.cfg.Store.RemoveRegion(ctx, a.ID, a.Revision); {
			case err == nil:
				l.removed[a.ID] = true
			case errors.Is(err, kvstate.ErrConflict):
				l.log.Debug("a silent region's registration changed since its silence began (renewed, or removed already): not removed", "region", a.ID)
			default:
				l.log.Warn("cannot remove dead region's registration", "region", a.ID, "err", err)
			}
		case StepDown:
			return fmt.Errorf("%w: %s", errStepDown, a.Reason)
		case Park:
			if l.cfg.Durable {
				continue // the stream keeps the shard's messages
			}
			if a.Fence != 0 {
				// Before the parking's first append, and bounded: the
				// leader's loop waits for it. A fence that cannot be
				// written ends the term rather than let the parking's
				// messages precede a zombie's in the buffer; the next
				// term finds the move where this one left it.
				fctx, cancel := context.WithTimeout(ctx, l.cfg.CommandTimeout)
				_, err := l.cfg.Buffer.Fence(fctx, a.Shard, a.Fence)
				cancel()
				if err != nil {
					return fmt.Errorf("%w: fence handoff %d of shard %d: %w", errStepDown, a.Fence, a.Shard, err)
				}
				l.log.Debug("fenced a handoff's source in the shard's buffer: what it appends from now on is not replayed", "shard", a.Shard, "handoff", a.Fence)
				fenced = append(fenced, a.Shard)
			}
			if err := l.parker.park(a.Shard, a.Handoff, l.info.Epoch); err != nil {
				return fmt.Errorf("%w: park shard %d: %w", errStepDown, a.Shard, err)
			}
		case Unpark:
			if l.cfg.Durable {
				go l.post(ctx, Unparked{Shard: a.Shard, Handoff: a.Handoff}) // no end marker: the new owner waits for none
				continue
			}
			unparks = append(unparks, a)
		case Mark:
			if l.cfg.Durable {
				go l.post(ctx, Marked{Shard: a.Shard, Handoff: a.Handoff})
				continue
			}
			if a.Fence {
				fencing = append(fencing, a.Shard)
			}
			go l.mark(ctx, a)
		case Warn:
			l.log.Warn(a.Msg)
		case RoundPlanned:
			l.roundAt = time.Now()
			l.log.Info("rebalance round", "round", a.Round, "moves", len(a.Moves), "from_to", movesSummary(a.Moves), "regions", countsSummary(a.Regions))
			l.log.Debug("rebalance round's moves", "round", a.Round, "shards", shardsOf(a.Moves))
		case RoundDone:
			args := []any{"round", a.Round, "moved", a.Moved, "took", duration(time.Since(l.roundAt))}
			if a.Dropped > 0 {
				args = append(args, "dropped", a.Dropped, "why", a.Reason)
			}
			l.log.Info("rebalance round done", args...)
		case NoRound:
			level := slog.LevelInfo
			if a.Settling {
				level = slog.LevelDebug
			}
			l.log.Log(ctx, level, "no rebalance round", "reason", a.Reason)
		}
	}
	if err := flush(); err != nil {
		return err
	}
	if len(unparks) > 0 {
		go l.unpark(ctx, unparks)
	}
	return nil
}

// waitsForWrites reports whether action a must wait for the table writes
// before it: all but log lines, the Park of another shard (a Park starts
// diverting a shard's messages, whatever the other rows say) and an
// Unpark (execute gathers them and starts them after its last writes) do.
func waitsForWrites(a Action, writes []protocol.ShardRecord) bool {
	switch a := a.(type) {
	case Warn, RoundPlanned, RoundDone, NoRound, Unpark:
		return false
	case Park:
		return slices.ContainsFunc(writes, func(r protocol.ShardRecord) bool { return r.Shard == a.Shard })
	}
	return true
}

// writeShards writes rows of the table (at most kvstate.MaxShardBatch):
// as one batch where the store has them go as one (kvstate.Store.Batches)
// and the server takes it, else one row after another. Before the batch,
// and before each row, it renews the lease when that is due: under load
// a row alone took a quarter of a second, and 22 of them outlasted a 4 s
// lease that nothing renewed meanwhile (the server expired it; the rest
// were refused as fenced, and the term ended).
func (l *leader) writeShards(ctx context.Context, recs []protocol.ShardRecord) error {
	if len(recs) == 0 {
		return nil
	}
	if l.cfg.Store.Batches(len(recs)) {
		if err := l.renewIfDue(ctx); err != nil {
			return err
		}
		err := l.cfg.Store.PutShards(ctx, l.lease, recs)
		if err == nil {
			l.written(recs)
			return nil
		}
		if !errors.Is(err, kvstate.ErrBatchRefused) {
			return fmt.Errorf("%w: write %d shards from shard %d: %w", errStepDown, len(recs), recs[0].Shard, err)
		}
		l.log.Debug("the table's rows go one at a time", "rows", len(recs), "why", err)
	}
	for i := range recs {
		if err := l.renewIfDue(ctx); err != nil {
			return err
		}
		if _, err := l.cfg.Store.PutShard(ctx, l.lease, recs[i]); err != nil {
			return fmt.Errorf("%w: write shard %d: %w", errStepDown, recs[i].Shard, err)
		}
		l.written(recs[i : i+1])
	}
	return nil
}

// written records rows of the table just written: for the moves' timing,
// the log and the event stream.
func (l *leader) written(recs []protocol.ShardRecord) {
	now := time.Now()
	for _, rec := range recs {
		l.track.written(rec, now)
		l.log.Debug("shard", "shard", rec.Shard, "region", rec.Region, "state", rec.State)
		l.publish(protocol.Event{Kind: protocol.EventShard, Shard: &rec.Shard, State: string(rec.State), Region: rec.Region, Source: rec.Source})
	}
}

// unpark ends the parking of shards whose new owner is replaying their
// buffer: after the grace period (so that the owner's subscription is known
// to every server of a cluster), it unsubscribes and appends the end
// markers, then reports each shard Unparked. The buffer of a shard whose
// owner was live already (Unpark.Live) is purged instead. (Ending 32
// shards at a time made no difference that three runs of
// BenchmarkRegions could see: docs/bench-log/scaling.md.)
func (l *leader) unpark(ctx context.Context, us []Unpark) {
	if !wait.Sleep(ctx, l.cfg.ReleaseGrace) {
		return // the term ended: the next one parks the shards again, or stops parking them
	}
	for _, u := range us {
		l.parker.unsubscribe(u.Shard, u.Handoff, l.info.Epoch)
	}
	for _, u := range us {
		done := false
		if u.Live {
			done = l.purgeRetrying(ctx, u.Shard)
		} else {
			done = l.markRetrying(ctx, u.Shard, u.Handoff)
		}
		if done {
			l.post(ctx, Unparked{Shard: u.Shard, Handoff: u.Handoff})
		}
	}
}

// purgeRetrying empties a shard's buffer once the appends of its parking
// are acknowledged: everything in it is a copy of what its live owner
// handled (the owner purged up to its own end marker before it went live).
func (l *leader) purgeRetrying(ctx context.Context, shard int) bool {
	for ctx.Err() == nil {
		err := l.cfg.Buffer.Flush(ctx)
		if err == nil {
			err = l.cfg.Buffer.Purge(ctx, shard, math.MaxUint64)
		}
		if err == nil {
			l.log.Info("purged a parked shard's buffer: its owner was live already", "shard", shard)
			return true
		}
		l.log.Warn("cannot purge a parked shard's buffer; retrying", "shard", shard, "err", err)
		wait.Sleep(ctx, 500*time.Millisecond)
	}
	return false
}

// mark appends an end marker for a source that died.
func (l *leader) mark(ctx context.Context, m Mark) {
	if m.Fence && !l.fenceRetrying(ctx, m.Shard, m.Handoff) {
		return
	}
	if l.markRetrying(ctx, m.Shard, m.Handoff) {
		l.post(ctx, Marked{Shard: m.Shard, Handoff: m.Handoff})
	}
}

func (l *leader) markRetrying(ctx context.Context, shard int, handoff uint64) bool {
	for ctx.Err() == nil {
		if _, err := l.cfg.Buffer.Mark(ctx, shard, handoff); err == nil {
			return true
		} else {
			l.log.Warn("cannot write an end marker; retrying", "shard", shard, "handoff", handoff, "err", err)
		}
		wait.Sleep(ctx, 500*time.Millisecond)
	}
	return false
}

// fenceRetrying fences handoff in shard's buffer (kvstate.Buffer.Fence),
// retrying until it is written or ctx ends.
func (l *leader) fenceRetrying(ctx context.Context, shard int, handoff uint64) bool {
	for ctx.Err() == nil {
		if _, err := l.cfg.Buffer.Fence(ctx, shard, handoff); err == nil {
			l.log.Debug("fenced a handoff's source in the shard's buffer: what it appends from now on is not replayed", "shard", shard, "handoff", handoff)
			return true
		} else {
			l.log.Warn("cannot fence a handoff's source in the shard's buffer; retrying", "shard", shard, "handoff", handoff, "err", err)
		}
		wait.Sleep(ctx, 500*time.Millisecond)
	}
	return false
}

func (l *leader) post(ctx context.Context, ev Event) {
	select {
	case l.events <- ev:
	case <-ctx.Done():
	}
}

func (l *leader) send(ctx context.Context, s Send) {
	done := CommandDone{Send: s, Outcome: Failed}
	data, err := protocol.Encode(s.Command)
	if err == nil {
		var m *nats.Msg
		rctx, cancel := context.WithTimeout(ctx, l.cfg.CommandTimeout)
		m, err = l.cfg.Conn.RequestWithContext(rctx, l.cfg.Subjects.Region(s.Region), data)
		cancel()
		switch {
		case errors.Is(err, nats.ErrNoResponders):
			done.Outcome = NoResponders
		case err != nil:
		case protocol.Decode(m.Data, &done.Reply) != nil:
			err = errors.New("undecodable reply")
		case done.Reply.Error != "":
			done.Outcome = Refused
		default:
			done.Outcome = OK
		}
	}
	if err != nil || done.Outcome == Refused {
		l.log.Debug("command", "kind", s.Command.Kind, "region", s.Region, "outcome", done.Outcome, "err", err, "refusal", done.Reply.Error)
	}
	l.post(ctx, done)
}

// watchRegions turns registry changes into core events. The returned
// channel closes when the watch is lost; the caller watches again.
func (l *leader) watchRegions(ctx context.Context) <-chan Event {
	out := make(chan Event)
	go func() {
		defer close(out)
		var events <-chan kvstate.RegionEvent
		for ctx.Err() == nil {
			var err error
			if events, err = l.cfg.Store.WatchRegions(ctx); err == nil {
				break
			}
			l.log.Warn("cannot watch regions; retrying", "err", err)
			wait.Sleep(ctx, time.Second)
		}
		if events == nil {
			return // ctx ended before a watch began (ranging over nil would block for ever)
		}
		var ids []string
		synced := false
		for ev := range events {
			var e Event
			switch {
			case ev.Synced:
				synced = true
				e = RegionsSynced{IDs: ids}
			case ev.Info == nil:
				e = RegionGone{ID: ev.ID}
			default:
				if !synced {
					ids = append(ids, ev.ID)
				}
				e = RegionUp{RegionSeen{Info: *ev.Info, Revision: ev.Revision}}
			}
			select {
			case out <- e:
			case <-ctx.Done():
				return
			}
		}
	}()
	return out
}

// answerAdmin answers an admin API request. The actions a request starts
// (table and pin writes, commands) are carried out before the answer, so
// that an answer of success means they were accepted; an error carrying
// them out ends the term, like any failed write.
func (l *leader) answerAdmin(ctx context.Context, m *nats.Msg) error {
	var (
		body any
		acts []Action
		err  error
	)
	if verb := m.Subject[len(l.cfg.Subjects.Admin("")):]; verb == protocol.AdminStatus {
		body = l.status()
	} else {
		body, acts, err = l.core.AdminRequest(verb, m.Data)
	}
	var failed error
	if err == nil {
		failed = l.execute(ctx, acts)
		err = failed
	}
	if err != nil {
		body = protocol.AdminError{Error: err.Error(), Retry: errors.Is(err, ErrSplitBusy) && failed == nil}
	}
	data, _ := json.Marshal(body)
	if m.Reply != "" {
		_ = m.Respond(data)
	}
	return failed
}

// publish announces ev on the events subject (core NATS: nobody may be
// listening, and a slow watcher may miss events).
func (l *leader) publish(ev protocol.Event) {
	ev.Time = time.Now().UTC().Format(time.RFC3339Nano)
	ev.Epoch = l.core.Epoch()
	data, err := json.Marshal(ev)
	if err == nil {
		err = l.cfg.Conn.Publish(l.cfg.Subjects.Events(), data)
	}
	if err != nil {
		l.log.Debug("cannot publish an event", "kind", ev.Kind, "err", err)
	}
}

// announceRegions logs and publishes the regions that registered, started
// leaving or are gone since the last call; acts are the actions of the
// step that changed them.
func (l *leader) announceRegions(acts []Action) {
	now := map[string]protocol.RegionInfo{}
	for _, r := range l.core.Regions() {
		now[r.Info.ID] = r.Info
		old, ok := l.seen[r.Info.ID]
		switch {
		case ok && old.Incarnation != r.Info.Incarnation:
			// The process behind the id restarted, or the region fenced
			// itself and registered again, empty.
			l.log.Info("region registered as a new incarnation: the old one's shards are re-homed", "region", r.Info.ID, "incarnation", r.Info.Incarnation, "was", old.Incarnation)
			l.publish(protocol.Event{Kind: protocol.EventRegionGone, Region: r.Info.ID})
			l.publish(protocol.Event{Kind: protocol.EventRegionUp, Region: r.Info.ID})
			if r.Info.Leaving {
				l.publish(protocol.Event{Kind: protocol.EventLeaving, Region: r.Info.ID})
			}
		case !ok:
			l.log.Info("region joined", "region", r.Info.ID, "incarnation", r.Info.Incarnation, "version", r.Info.Version, "leaving", r.Info.Leaving)
			l.publish(protocol.Event{Kind: protocol.EventRegionUp, Region: r.Info.ID})
			if r.Info.Leaving {
				l.publish(protocol.Event{Kind: protocol.EventLeaving, Region: r.Info.ID})
			}
		case r.Info.Leaving && !old.Leaving:
			l.log.Info("region leaving: its shards are handed off", "region", r.Info.ID)
			l.publish(protocol.Event{Kind: protocol.EventLeaving, Region: r.Info.ID})
		case !r.Info.Leaving && old.Leaving:
			l.log.Info("region undrained: it takes shards again", "region", r.Info.ID)
			l.publish(protocol.Event{Kind: protocol.EventUndrained, Region: r.Info.ID})
		}
	}
	for _, id := range slices.Sorted(maps.Keys(l.seen)) {
		if _, ok := now[id]; !ok {
			why := "its registration expired or was deleted"
			if l.removed[id] {
				why = "found dead: no responders on its command subject"
				delete(l.removed, id)
			}
			l.log.Info("region gone: its shards are re-homed", "region", id, "why", why)
			l.publish(protocol.Event{Kind: protocol.EventRegionGone, Region: id})
		}
	}
	l.seen = now
}

func (l *leader) status() protocol.Status {
	cfg := l.core.TypeConfig()
	st := protocol.Status{
		Type:        l.cfg.Subjects.Type(),
		Shards:      cfg.Shards,
		History:     cfg.History,
		SplittingTo: cfg.To,
		Coordinator: protocol.CoordinatorView{Region: l.cfg.Region, Epoch: l.core.Epoch()},
	}
	count := map[string]int{}
	pins := l.core.Pins()
	for _, r := range l.core.Table() {
		st.Table = append(st.Table, protocol.ShardView{Shard: r.Shard, Region: r.Region, State: string(r.State), Source: r.Source, Pin: pins[r.Shard]})
		count[r.Region]++
	}
	for _, r := range l.core.Regions() {
		st.Regions = append(st.Regions, protocol.RegionView{
			ID: r.Info.ID, Incarnation: r.Info.Incarnation, Version: r.Info.Version, Leaving: r.Info.Leaving, Shards: count[r.Info.ID],
		})
	}
	return st
}
