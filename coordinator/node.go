package coordinator

import (
	"context"
	"errors"
	"log/slog"
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
