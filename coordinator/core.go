package coordinator

import (
	"errors"
	"fmt"
	"slices"

	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/strategies"
)

// CoreConfig configures a Core. Times are counted in ticks.
type CoreConfig struct {
	Shards int // shard count of the type (TypeConfig's, when it has one)
	// TypeConfig is the type's stored configuration, read at takeover: its
	// layout (earlier counts, a split under way) and what a split writes
	// back. Zero: a type of Shards shards, never split.
	TypeConfig protocol.TypeConfig
	Strategy   strategies.Strategy // where shards go, which to rebalance
	// MinRegions: no shard is allocated until this many regions are
	// registered (Akka's min-nr-of-members). 0 or 1 allocates at once.
	MinRegions int
	// ProbeEvery: ticks between probes of each region (default 5).
	ProbeEvery int
	// Silence: ticks of nothing but "no responders" from a region, probe
	// after probe (one every tick through a silence), before it is
	// removed (default 3). Longer than a client's reconnect to another
	// server, which a region rides through (region.Agent.Suspend); a
	// server's report that the client closed or reset its connection
	// (ConnClosed.ByClient) removes it at the first "no responders".
	Silence int
	// Retry: ticks after which an unanswered command is sent again
	// (default 10).
	Retry int
	// HandOffTimeout: ticks a source may take to pause a shard before the
	// coordinator takes the shard over and drops it there (default 100).
	HandOffTimeout int
	// RebalanceEvery: ticks between the starts of strategy rounds (default
	// 20); negative disables rebalancing. A round's plan runs to its end
	// whatever this is: its moves start as earlier ones end.
	RebalanceEvery int
	// Settle: ticks during which membership must not have changed (no
	// region joined, left, died or started leaving) before a round runs
	// (default 10; negative: none). A change also drops what a round's plan
	// has not started yet.
	Settle int
	// MaxMoves bounds the moves of live shards in flight (default
	// DefaultMaxMoves): rounds and leaving regions start moves within it.
	MaxMoves int
	// Pins are the operators' pins read at takeover: shard -> region.
	// Pinned shards go to their region whenever it is registered and not
	// leaving (strategies.NewExternal in front of Strategy).
	Pins map[int]string
	// Stats, when set, counts the moves and rounds the core decides
	// (stats.go); it changes no decision.
	Stats *Stats
}

func (c *CoreConfig) setDefaults() {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def(&c.ProbeEvery, 5)
	def(&c.Silence, 3)
	def(&c.Retry, 10)
	def(&c.HandOffTimeout, 100)
	def(&c.RebalanceEvery, 20)
	def(&c.Settle, 10)
	def(&c.MaxMoves, DefaultMaxMoves)
}

// Core is the coordinator's decision logic for one epoch: it owns the
// shard table and the view of live regions, takes events and ticks, and
// returns the actions to carry out, in order. It does no I/O and reads no
// clock, so the same inputs give the same outputs. It is not safe for
// concurrent use.
//
// A shard's life (docs/PROTOCOL.md, "Handoff"): parked (the coordinator
// diverts its messages to the buffer) -> binding (a region replays the buffer
// up to the end marker of the move) -> active (the region serves it) ->
// handoff (the owner pauses it and stops its entities) -> binding -> active
// ... Every bind is the end of a move whose source is a region or the
// coordinator itself, so a shard always has someone catching its messages.
type Core struct {
	cfg       CoreConfig
	strategy  strategies.Strategy // cfg.Strategy behind the pins
	pins      map[int]string
	load      map[int]strategies.ShardLoad // last load each shard's owner reported
	self      string
	epoch     uint64
	tick      int
	regions   map[string]*regionState
	ids       []string                // the keys of regions, sorted; a new slice at each change
	table     []protocol.ShardRecord  // index is the shard number
	steps     []step                  // index is the shard number
	order     uint64                  // largest allocation order or handoff id used
	moving    int                     // moves of live shards in flight (rows in handoff, or binding from a region)
	parked    int                     // rows parked
	rows      map[string]map[int]bool // per region ID, the shards whose row names it as Region
	started   bool                    // MinRegions was reached once (or the table had owners)
	lastFlux  int                     // tick of the last membership change
	lastRound int                     // tick of the last rebalance round
	rounds    roundState              // the current rebalance round and its plan (rebalance.go)
	out       []Action
	stats     *Stats // CoreConfig.Stats, or a discarded one
	// typeCfg is the type's configuration as last written or read; layout
	// its counts (the last is the table's length); split the split between
	// its commit and its announce (split.go).
	typeCfg protocol.TypeConfig
	layout  protocol.Layout
	split   *splitState
}

// step is the coordinator's memory of a shard's current step; it is not
// in the table, so a new coordinator starts it afresh.
type step struct {
	at       int    // tick the step began
	sentAt   int    // tick the last command of the step was sent
	complete bool   // handoff: the source reported its entities stopped
	bound    bool   // binding: the target confirmed; the source is being released
	want     string // a target asked for by an operator
}

type regionState struct {
	RegionSeen
	probedAt int
	// A silence: "no responders" since tick silentAt, when the
	// registration was at silentRev (the removal is a compare-and-delete
	// at that revision); connGone: a server reported that the client
	// closed the connection the registration names.
	silent    bool
	silentAt  int
	silentRev uint64
	connGone  bool
}

// Errors of Core.Move, Core.Drain, Core.Undrain and Core.Pin.
var (
	ErrUnknownRegion = errors.New("coordinator: no such live region")
	ErrRegionBusy    = errors.New("coordinator: region holds shards")
	ErrShardBusy     = errors.New("coordinator: shard is not active")
	ErrPinned        = errors.New("coordinator: shard is pinned")
	ErrBadRequest    = errors.New("coordinator: bad request")
)

// NewCore starts the decisions of the coordinator that holds epoch, with the
// shard table and the registered regions read at takeover. Rows of table
// may be missing or out of order. The returned actions take over what was
// under way: shards of regions that are gone are parked, moves are rolled
// forward, every region is probed.
func NewCore(cfg CoreConfig, self string, epoch uint64, table []protocol.ShardRecord, regions []RegionSeen) (*Core, []Action) {
	cfg.setDefaults()
	if cfg.TypeConfig.Shards == 0 {
		cfg.TypeConfig.Shards = cfg.Shards
	}
	layout, err := cfg.TypeConfig.Layout()
	if err != nil {
		// The driver reads a stored configuration that is a layout
		// (kvstate checks it); a caller that gives none gets its Shards.
		cfg.TypeConfig = protocol.TypeConfig{Shards: cfg.Shards}
		layout = protocol.MustLayout(cfg.Shards)
	}
	cfg.Shards = layout.Shards()
	c := &Core{
		typeCfg: cfg.TypeConfig,
		layout:  layout,
		cfg:     cfg,
		self:    self,
		epoch:   epoch,
		regions: make(map[string]*regionState),
		rows:    map[string]map[int]bool{},
		table:   make([]protocol.ShardRecord, cfg.Shards),
		steps:   make([]step, cfg.Shards),
		pins:    make(map[int]string),
		load:    make(map[int]strategies.ShardLoad),
		stats:   cfg.Stats,
	}
	if c.stats == nil {
		c.stats = &Stats{}
	}
	for sh, id := range cfg.Pins {
		if sh >= 0 && sh < cfg.Shards && protocol.ValidateName("region id", id) == nil {
			c.pins[sh] = id
		}
	}
	c.strategy = strategies.NewExternal(c.pins, cfg.Strategy)
	for i := range c.table {
		c.table[i] = protocol.ShardRecord{Shard: i, State: protocol.StateUnowned}
	}
	for _, r := range table {
		if r.Shard >= 0 && r.Shard < cfg.Shards {
			c.setRow(r)
			c.order = max(c.order, r.Order, r.Handoff)
			c.started = c.started || r.Region != ""
		}
	}
	for _, r := range regions {
		c.regions[r.Info.ID] = &regionState{RegionSeen: r}
	}
	c.regionsChanged()
	if cfg.TypeConfig.To != 0 {
		c.takeOverSplit(table)
	}
	for sh := range c.table {
		c.takeOver(sh)
	}
	c.askSplit()
	c.probeAll()
	c.allocate()
	return c, c.flush()
}

// takeOver resumes shard sh as read from the table by a new coordinator.
func (c *Core) takeOver(sh int) {
	rec := c.table[sh]
	switch rec.State {
	case protocol.StateActive:
		if !c.live(rec.Region, rec.Incarnation) {
			c.park(sh)
		}
	case protocol.StateParked:
		c.out = append(c.out, Park{Shard: sh, Handoff: rec.Handoff})
	case protocol.StateHandoff:
		if c.live(rec.Source, rec.SourceIncarnation) {
			c.sendHandOff(sh)
		} else {
			c.park(sh)
		}
	case protocol.StateBinding:
		target := c.live(rec.Region, rec.Incarnation)
		if rec.Source == "" {
			// The previous coordinator diverted. Its parking ended with
			// its term, unless this process ran it (then it is adopted).
			// A live target may have subscribed and be holding what
			// arrived since, which is older than anything a new parking
			// would append: it is not parked again; the end marker
			// follows its confirmation of the bind (Unpark). A target
			// that is gone is not holding anything: the shard is parked
			// again for the next one.
			c.out = append(c.out, Park{Shard: sh, Handoff: rec.Handoff, Adopt: target})
		} else if !c.live(rec.Source, rec.SourceIncarnation) {
			c.sourceGone(sh)
			return
		}
		if target {
			c.sendBind(sh)
		} else {
			c.retarget(sh)
		}
	default: // unowned, or a state this version does not know: park
		c.park(sh)
	}
}

// Epoch is the epoch this core decides for.
func (c *Core) Epoch() uint64 { return c.epoch }

// Table returns a copy of the shard table.
func (c *Core) Table() []protocol.ShardRecord { return slices.Clone(c.table) }

// Regions returns the live regions, by ID.
func (c *Core) Regions() []RegionSeen {
	out := make([]RegionSeen, 0, len(c.regions))
	for _, id := range c.sortedRegionIDs() {
		out = append(out, c.regions[id].RegionSeen)
	}
	return out
}

// Step applies one event and returns the actions it calls for.
func (c *Core) Step(ev Event) []Action {
	switch ev := ev.(type) {
	case RegionUp:
		c.regionUp(ev.RegionSeen)
	case RegionGone:
		c.regionGone(ev.ID)
	case RegionsSynced:
		keep := make(map[string]bool, len(ev.IDs))
		for _, id := range ev.IDs {
			keep[id] = true
		}
		for _, id := range c.sortedRegionIDs() {
			if !keep[id] {
				c.regionGone(id)
			}
		}
	case ConnClosed:
		c.connClosed(ev)
	case CommandDone:
		c.commandDone(ev)
	case Unparked:
		if rec := c.table[ev.Shard]; rec.State == protocol.StateBinding && rec.Source == "" && rec.Handoff == ev.Handoff {
			c.activate(ev.Shard)
		}
	case Marked:
		if rec := c.table[ev.Shard]; rec.State == protocol.StateBinding && rec.Handoff == ev.Handoff {
			c.activate(ev.Shard)
		}
	}
	// Moves that ended make room for the next ones at once.
	c.moveOffLeaving()
	c.continuePlan()
	c.askSplit()
	return c.flush()
}

// Tick advances logical time by one tick: probes regions that are due,
// resends commands that were not answered in time, times out handoffs,
// moves shards off leaving regions and runs the rebalance round when due.
func (c *Core) Tick() []Action {
	c.tick++
	for _, id := range c.sortedRegionIDs() {
		if r := c.regions[id]; c.tick-r.probedAt >= c.cfg.ProbeEvery {
			c.probe(r)
		}
	}
	for sh, rec := range c.table {
		st := &c.steps[sh]
		switch rec.State {
		case protocol.StateHandoff:
			if c.tick-st.at >= c.cfg.HandOffTimeout {
				c.handOffTimedOut(sh)
			} else if c.tick-st.sentAt >= c.cfg.Retry {
				c.sendHandOff(sh)
			}
		case protocol.StateBinding:
			switch {
			case c.tick-st.sentAt < c.cfg.Retry:
			case !st.bound:
				c.sendBind(sh)
			case rec.Source != "":
				c.sendRelease(sh) // an Unpark always completes; a Release may need asking again
			}
		}
	}
	c.allocate()
	c.moveOffLeaving()
	c.continuePlan()
	c.rebalance()
	c.askSplit()
	return c.flush()
}

// Move starts moving an active shard to target (shardctl move).
func (c *Core) Move(shard int, target string) ([]Action, error) {
	if err := c.checkShard(shard); err != nil {
		return nil, err
	}
	r, ok := c.regions[target]
	if !ok || r.Info.Leaving {
		return nil, fmt.Errorf("%w: %q (leaving regions take no shard)", ErrUnknownRegion, target)
	}
	if pin, ok := c.pins[shard]; ok && pin != target {
		return nil, fmt.Errorf("%w to %s (unpin shard %d first)", ErrPinned, pin, shard)
	}
	rec := c.table[shard]
	if rec.State != protocol.StateActive {
		return nil, fmt.Errorf("%w: shard %d is %s", ErrShardBusy, shard, rec.State)
	}
	if c.split != nil {
		return nil, fmt.Errorf("%w: the type splits to %d shards; shards move again once the split is announced", ErrShardBusy, c.split.to)
	}
	if rec.Region == target {
		return nil, nil // already there
	}
	c.startMove(shard)
	c.steps[shard].want = target
	return c.flush(), nil
}

// Drain asks a region to leave: it marks itself leaving, and its shards
// are then handed off to the others (shardctl drain).
func (c *Core) Drain(region string) ([]Action, error) {
	r, ok := c.regions[region]
	if !ok {
		return nil, fmt.Errorf("%w: %q", ErrUnknownRegion, region)
	}
	c.send(r, protocol.CmdLeave, nil, nil)
	return c.flush(), nil
}
