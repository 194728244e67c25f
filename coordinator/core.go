package coordinator

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

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
		if rec.Source == "" {
			// The previous coordinator diverted; this one does now.
			c.out = append(c.out, Park{Shard: sh, Handoff: rec.Handoff})
		} else if !c.live(rec.Source, rec.SourceIncarnation) {
			c.sourceGone(sh)
			return
		}
		if c.live(rec.Region, rec.Incarnation) {
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

func (c *Core) regionUp(seen RegionSeen) {
	id := seen.Info.ID
	if old, ok := c.regions[id]; ok {
		if old.Info.Incarnation == seen.Info.Incarnation {
			if old.Info.Leaving != seen.Info.Leaving {
				c.flux()
			}
			if seen.Revision != old.Revision {
				// Renewed: the region is there (back from a reconnect, it
				// names its new connection); a removal at the old revision
				// would fail anyway.
				old.silent, old.connGone = false, false
			}
			old.RegionSeen = seen
			c.moveOffLeaving()
			return
		}
		// A new incarnation under the same id: the old one's shards are gone.
		c.regionGone(id)
	}
	c.regions[id] = &regionState{RegionSeen: seen, probedAt: c.tick}
	c.regionsChanged()
	c.flux()
	c.allocate()
}

// regionGone forgets a region and rescues its shards: those it owned are
// parked, moves from it are taken over, moves to it get another target.
func (c *Core) regionGone(id string) {
	r, ok := c.regions[id]
	if !ok {
		return
	}
	delete(c.regions, id)
	c.regionsChanged()
	c.flux()
	if c.split != nil {
		delete(c.split.split, id)
		delete(c.split.askedAt, id)
	}
	inc := r.Info.Incarnation
	for sh, rec := range c.table {
		isOwner := rec.Region == id && rec.Incarnation == inc
		isSource := rec.Source == id && rec.SourceIncarnation == inc
		switch {
		case rec.State == protocol.StateActive && isOwner:
			c.park(sh)
		case rec.State == protocol.StateHandoff && isSource:
			// It died pausing: its appends are in the buffer, no marker.
			// Or it is frozen: fenced, whatever it appends later is not
			// replayed.
			c.stats.HandOffsForced.Add(1)
			c.parkFenced(sh, rec.Handoff)
		case rec.State == protocol.StateBinding && isSource:
			c.sourceGone(sh)
		case rec.State == protocol.StateBinding && isOwner:
			c.retarget(sh)
		}
	}
	c.allocate()
	c.maybeAnnounce()
}

// connClosed probes the regions whose registration names the closed
// connection, now and at the next tick (in a cluster the report may reach
// the coordinator before the end of the region's interest reaches every
// server: a probe then times out rather than find no responders).
func (c *Core) connClosed(ev ConnClosed) {
	if ev.Conn.IsZero() {
		return
	}
	for _, id := range c.sortedRegionIDs() {
		if r := c.regions[id]; r.Info.Conn == ev.Conn {
			r.connGone = r.connGone || ev.ByClient
			c.probe(r)
			r.probedAt = c.tick - c.cfg.ProbeEvery + 1
		}
	}
}

// silence counts a "no responders" to command s of region r: the
// region's subscriptions are gone from the servers. Its connection may be
// coming back (a client reconnects to another server within
// milliseconds, and a region rides that through), so the region is probed
// every tick and removed once it has been silent for Silence ticks, or at
// once when a server reported that its client closed or reset it. The
// removal is a compare-and-delete at the revision of the registration
// when the silence began: a region that renewed since keeps it. Its
// shards are rescued when the watch reports the registration gone.
func (c *Core) silence(r *regionState, s Send) {
	if !r.silent {
		r.silent, r.silentAt, r.silentRev = true, s.At, s.Revision
	}
	if r.connGone || s.At-r.silentAt >= c.cfg.Silence {
		c.out = append(c.out, RemoveRegion{ID: r.Info.ID, Revision: r.silentRev})
		return
	}
	r.probedAt = c.tick - c.cfg.ProbeEvery + 1 // probe it again at the next tick
}

// sourceGone: the source of a binding shard died before it wrote its end
// marker. The target is subscribed and holds what arrives since, so the
// coordinator writes the marker for the source.
func (c *Core) sourceGone(sh int) {
	c.stats.HandOffsForced.Add(1)
	rec := c.table[sh]
	if !c.live(rec.Region, rec.Incarnation) {
		c.parkFenced(sh, rec.Handoff)
		return
	}
	rec.Source, rec.SourceIncarnation = "", ""
	c.write(rec)
	c.out = append(c.out, Mark{Shard: sh, Handoff: rec.Handoff, Fence: true})
}

func (c *Core) commandDone(ev CommandDone) {
	s := ev.Send
	r, ok := c.regions[s.Region]
	if !ok || r.Info.Incarnation != s.Command.Incarnation {
		return // about a region or incarnation that is gone: nothing to do
	}
	if ev.Outcome != NoResponders {
		r.silent = false // it answered, or the outcome proves nothing (a timeout)
	}
	switch ev.Outcome {
	case NoResponders:
		c.silence(r, s)
		return
	case Failed:
		return // resent by Tick
	case Refused:
		if ev.Reply.Epoch > c.epoch {
			c.out = append(c.out, StepDown{Reason: fmt.Sprintf("region %s has seen epoch %d, newer than %d", s.Region, ev.Reply.Epoch, c.epoch)})
			return
		}
		if ev.Reply.Incarnation != "" && ev.Reply.Incarnation != r.Info.Incarnation {
			// The process behind the id restarted; its new registration
			// arrives through the watch.
			c.regionGone(s.Region)
		}
		return // other refusals: resent by Tick
	}
	cmd := s.Command
	for i, sh := range cmd.Shards {
		rec := c.table[sh]
		var h uint64
		if i < len(cmd.Handoffs) {
			h = cmd.Handoffs[i]
		}
		switch cmd.Kind {
		case protocol.CmdHandOff:
			if rec.State != protocol.StateHandoff || rec.Handoff != h || rec.Source != s.Region {
				break
			}
			if ev.Reply.Complete {
				c.steps[sh].complete = true
				c.chooseTarget(sh, rec.Source)
			} else if slices.Contains(ev.Reply.Replaying, sh) {
				// The source is still replaying the shard's previous move:
				// busy, not stuck. Forcing the move now would drop what
				// it holds; the timeout counts from when it is live.
				c.steps[sh].at = c.tick
			}
		case protocol.CmdBind:
			if rec.State == protocol.StateBinding && rec.Handoff == h && rec.Region == s.Region && !c.steps[sh].bound {
				c.steps[sh].bound = true
				if rec.Source == "" {
					c.out = append(c.out, Unpark{Shard: sh, Handoff: h, Live: slices.Contains(ev.Reply.Live, sh)})
				} else {
					c.sendRelease(sh)
				}
			}
		case protocol.CmdRelease:
			if rec.State == protocol.StateBinding && rec.Handoff == h && rec.Source == s.Region {
				c.stats.HandOffsCompleted.Add(1)
				c.activate(sh)
			}
		}
	}
	switch cmd.Kind {
	case protocol.CmdProbe:
		c.recordLoad(r, ev.Reply.Load)
		c.reconcile(r, ev.Reply.Held, s.At)
	case protocol.CmdSplit:
		c.splitDone(r, cmd, ev.Reply)
	}
}

// recordLoad keeps the loads a region reported for the shards it owns and
// serves. A shard keeps its last known load when it moves, until its new
// owner has measured it.
func (c *Core) recordLoad(r *regionState, loads []protocol.ShardLoad) {
	for _, l := range loads {
		if l.Shard < 0 || l.Shard >= len(c.table) {
			continue
		}
		if rec := c.table[l.Shard]; rec.State == protocol.StateActive && rec.Region == r.Info.ID && rec.Incarnation == r.Info.Incarnation {
			c.load[l.Shard] = strategies.ShardLoad{MessagesPerSecond: l.Rate, Entities: l.Entities}
		}
	}
}

// reconcile compares what a region said it holds, in answer to a probe
// sent at tick at, with the table: a shard it holds without reason is
// dropped; a shard that was already active on it when the probe was sent
// and that it does not hold is parked and allocated again. (Commands run
// concurrently, so a probe may overtake the Bind of a shard.)
func (c *Core) reconcile(r *regionState, held []int, at int) {
	has := make(map[int]bool, len(held))
	var drop []int
	for _, sh := range held {
		if sh < 0 || sh >= len(c.table) {
			continue
		}
		has[sh] = true
		rec := c.table[sh]
		owner := rec.Region == r.Info.ID && rec.Incarnation == r.Info.Incarnation
		source := rec.Source == r.Info.ID && rec.SourceIncarnation == r.Info.Incarnation
		if !owner && !source {
			drop = append(drop, sh)
		}
	}
	if len(drop) > 0 {
		c.send(r, protocol.CmdDrop, drop, nil)
	}
	for _, sh := range c.rowsOf(r.Info.ID) {
		if c.split != nil && sh >= c.split.from && !c.hasSplit(r.Info.ID) {
			continue // a child of a shard it holds: it serves it once it split
		}
		if rec := c.table[sh]; rec.State == protocol.StateActive && rec.Incarnation == r.Info.Incarnation && !has[sh] && c.steps[sh].at < at {
			c.park(sh)
		}
	}
	c.allocate()
}

// park makes the coordinator the holder of shard sh under a new handoff id:
// it starts diverting first, then records it.
func (c *Core) park(sh int) { c.parkFenced(sh, 0) }

// parkFenced is park, fencing handoff id fence first (0: none; see Park).
func (c *Core) parkFenced(sh int, fence uint64) {
	c.order++
	rec := c.table[sh]
	c.out = append(c.out, Park{Shard: sh, Handoff: c.order, Fence: fence})
	c.write(protocol.ShardRecord{Shard: sh, State: protocol.StateParked, Order: rec.Order, Epoch: c.epoch, Handoff: c.order})
	c.steps[sh] = step{at: c.tick}
}

// allocate binds every parked shard to a region chosen by the strategy.
// The first allocation waits for MinRegions; later ones never do.
func (c *Core) allocate() {
	c.started = c.started || len(c.regions) >= max(c.cfg.MinRegions, 1)
	if !c.started || c.parked == 0 {
		return
	}
	var binds map[string][]int
	view := c.strategyView("") // kept up to date as shards are placed
	for sh, rec := range c.table {
		if rec.State != protocol.StateParked {
			continue
		}
		target, ok := c.pickTargetIn(sh, "", view)
		if !ok {
			return // no region can take shards now
		}
		c.bindTo(sh, target, "", "")
		c.placeInView(view, sh)
		if binds == nil {
			binds = map[string][]int{}
		}
		binds[target] = append(binds[target], sh)
	}
	for _, id := range slices.Sorted(maps.Keys(binds)) {
		c.sendBindBatch(id, binds[id])
	}
}

// startMove begins the handoff of an active shard from its owner.
func (c *Core) startMove(sh int) {
	c.order++
	rec := c.table[sh]
	rec.State = protocol.StateHandoff
	rec.Source, rec.SourceIncarnation = rec.Region, rec.Incarnation
	rec.Handoff = c.order
	rec.Epoch = c.epoch
	c.write(rec)
	c.steps[sh] = step{at: c.tick}
	c.stats.HandOffsStarted.Add(1)
	c.sendHandOff(sh)
}

// chooseTarget continues a paused shard's move: bind it to a target other
// than exclude (its source), or, with none available, take it over (park)
// and release the source.
func (c *Core) chooseTarget(sh int, exclude string) {
	rec := c.table[sh]
	target, ok := c.pickTargetIn(sh, exclude, nil)
	if !ok {
		src := c.regions[rec.Source]
		h := rec.Handoff
		c.park(sh)
		if src != nil {
			c.send(src, protocol.CmdRelease, []int{sh}, []uint64{h})
		}
		return
	}
	c.bindTo(sh, target, rec.Source, rec.SourceIncarnation)
	c.sendBind(sh)
}

// retarget gives a binding shard whose target died another target.
func (c *Core) retarget(sh int) {
	rec := c.table[sh]
	target, ok := c.pickTargetIn(sh, rec.Source, nil)
	if !ok {
		if rec.Source == "" {
			c.park(sh)
		} else if src := c.regions[rec.Source]; src != nil {
			h := rec.Handoff
			c.park(sh)
			c.send(src, protocol.CmdRelease, []int{sh}, []uint64{h})
		} else {
			c.park(sh)
		}
		return
	}
	c.bindTo(sh, target, rec.Source, rec.SourceIncarnation)
	c.sendBind(sh)
}

// bindTo records shard sh binding to target; the caller sends the Bind.
func (c *Core) bindTo(sh int, target, source, sourceInc string) {
	rec := c.table[sh]
	r := c.regions[target]
	rec.State = protocol.StateBinding
	rec.Region, rec.Incarnation = target, r.Info.Incarnation
	rec.Source, rec.SourceIncarnation = source, sourceInc
	rec.Epoch = c.epoch
	c.write(rec)
	want := c.steps[sh].want
	c.steps[sh] = step{at: c.tick, sentAt: c.tick, want: want}
}

func (c *Core) activate(sh int) {
	rec := c.table[sh]
	c.write(protocol.ShardRecord{
		Shard: sh, Region: rec.Region, Incarnation: rec.Incarnation,
		State: protocol.StateActive, Order: rec.Handoff, Epoch: c.epoch,
	})
	c.steps[sh] = step{at: c.tick}
}

// handOffTimedOut: the source did not pause in time. The coordinator takes
// the shard over (parks it under the same id: the source writes no marker
// for it), tells the source to drop it, and continues the move. This is the
// documented forced reallocation: the source's stuck entities may still run.
// The park fences the handoff first: a source that was frozen, and wakes
// up to pause the shard after all, appends behind the coordinator's
// messages, and no replay must take those appends (issue 30, A).
func (c *Core) handOffTimedOut(sh int) {
	rec := c.table[sh]
	source := rec.Source
	c.stats.HandOffsTimedOut.Add(1)
	c.out = append(c.out, Warn{Msg: fmt.Sprintf("handoff of shard %d from region %s timed out; dropping it there and reallocating", sh, source)})
	c.out = append(c.out, Park{Shard: sh, Handoff: rec.Handoff, Fence: rec.Handoff})
	if src, ok := c.regions[source]; ok {
		c.send(src, protocol.CmdDrop, []int{sh}, nil)
	}
	rec.Source, rec.SourceIncarnation = "", ""
	c.setRow(rec)
	c.chooseTarget(sh, source)
}

// pickTargetIn chooses where shard sh goes: the operator's wish if it can
// take it, else the strategy's choice among the regions other than
// exclude, in view (the strategy's view, which must leave out exclude;
// nil: built here).
func (c *Core) pickTargetIn(sh int, exclude string, view []strategies.Region) (string, bool) {
	if want := c.steps[sh].want; want != "" && want != exclude && c.hasSplit(want) {
		if r, ok := c.regions[want]; ok && !r.Info.Leaving {
			return want, true
		}
	}
	if view == nil {
		view = c.strategyView(exclude)
	}
	if len(view) == 0 {
		return "", false
	}
	id, err := c.strategy.Allocate(sh, "", view)
	if r, ok := c.regions[id]; err != nil || !ok || r.Info.Leaving || id == exclude {
		return "", false
	}
	return id, true
}

func (c *Core) sendHandOff(sh int) {
	rec := c.table[sh]
	if r, ok := c.regions[rec.Source]; ok {
		c.steps[sh].sentAt = c.tick
		c.send(r, protocol.CmdHandOff, []int{sh}, []uint64{rec.Handoff})
	}
}

func (c *Core) sendBind(sh int) {
	rec := c.table[sh]
	if r, ok := c.regions[rec.Region]; ok {
		c.steps[sh].sentAt = c.tick
		c.send(r, protocol.CmdBind, []int{sh}, []uint64{rec.Handoff})
	}
}

func (c *Core) sendRelease(sh int) {
	rec := c.table[sh]
	if r, ok := c.regions[rec.Source]; ok {
		c.steps[sh].sentAt = c.tick
		c.send(r, protocol.CmdRelease, []int{sh}, []uint64{rec.Handoff})
	}
}

func (c *Core) sendBindBatch(region string, shards []int) {
	hs := make([]uint64, len(shards))
	for i, sh := range shards {
		hs[i] = c.table[sh].Handoff
	}
	c.send(c.regions[region], protocol.CmdBind, shards, hs)
}

func (c *Core) probeAll() {
	for _, id := range c.sortedRegionIDs() {
		c.probe(c.regions[id])
	}
}

func (c *Core) probe(r *regionState) {
	r.probedAt = c.tick
	c.send(r, protocol.CmdProbe, nil, nil)
}

func (c *Core) send(r *regionState, kind protocol.CommandKind, shards []int, handoffs []uint64) {
	c.out = append(c.out, Send{At: c.tick, Revision: r.Revision, Region: r.Info.ID, Command: protocol.Command{
		Kind: kind, Epoch: c.epoch, Coordinator: c.self, Incarnation: r.Info.Incarnation, Shards: shards, Handoffs: handoffs,
	}})
}

func (c *Core) write(rec protocol.ShardRecord) {
	c.setRow(rec)
	c.out = append(c.out, WriteShard{Record: rec})
}

// setRow changes a row of the table, keeping count of the moves in flight
// and the parked rows, and the shards of each region.
func (c *Core) setRow(rec protocol.ShardRecord) {
	old := c.table[rec.Shard]
	if isMove(old) {
		c.moving--
	}
	if isMove(rec) {
		c.moving++
	}
	if old.State == protocol.StateParked {
		c.parked--
	}
	if rec.State == protocol.StateParked {
		c.parked++
	}
	if old.Region != rec.Region {
		if m := c.rows[old.Region]; m != nil {
			delete(m, rec.Shard)
			if len(m) == 0 {
				delete(c.rows, old.Region)
			}
		}
		if rec.Region != "" {
			if c.rows[rec.Region] == nil {
				c.rows[rec.Region] = map[int]bool{}
			}
			c.rows[rec.Region][rec.Shard] = true
		}
	}
	c.table[rec.Shard] = rec
}

// rowsOf is the shards whose row names region id, in shard order: a walk of
// the region's rows instead of the whole table.
func (c *Core) rowsOf(id string) []int {
	return slices.Sorted(maps.Keys(c.rows[id]))
}

// isMove says whether a row is a move of a live shard: a handoff, or a
// bind whose source is a region.
func isMove(rec protocol.ShardRecord) bool {
	return rec.State == protocol.StateHandoff || rec.State == protocol.StateBinding && rec.Source != ""
}

// live reports whether region id with incarnation inc is registered.
func (c *Core) live(id, inc string) bool {
	r, ok := c.regions[id]
	return ok && id != "" && r.Info.Incarnation == inc
}

// strategyView is the regions as the strategy sees them, except exclude:
// each with the shards it holds (active, binding to it, or pausing on it
// for a handoff), oldest allocation first. A pausing shard counts where
// it is until it binds elsewhere, so that placing one move's shard does
// not see its source emptier than it is because of the others in flight.
func (c *Core) strategyView(exclude string) []strategies.Region {
	at := make(map[string]int, len(c.regions))
	view := make([]strategies.Region, 0, len(c.regions))
	for _, id := range c.sortedRegionIDs() {
		if id == exclude || !c.hasSplit(id) {
			continue // during a split, only regions that split take shards
		}
		r := c.regions[id]
		at[id] = len(view)
		view = append(view, strategies.Region{ID: id, Version: r.Info.Version, Leaving: r.Info.Leaving})
	}
	// One walk of the table for all regions (regions x shards was the
	// cost of a first allocation: docs/bench-log/scaling.md).
	held := make([][]protocol.ShardRecord, len(view))
	for _, rec := range c.table {
		i, ok := at[rec.Region]
		if ok && holds(rec) && rec.Incarnation == c.regions[rec.Region].Info.Incarnation {
			held[i] = append(held[i], rec)
		}
	}
	for i := range view {
		slices.SortFunc(held[i], func(a, b protocol.ShardRecord) int {
			return cmp.Or(cmp.Compare(a.Order, b.Order), cmp.Compare(a.Shard, b.Shard))
		})
		shards := make([]int, len(held[i]))
		var load []strategies.ShardLoad
		known := true
		for j, h := range held[i] {
			shards[j] = h.Shard
			// Load is positional: it stops at the first shard whose load
			// is not known yet, and the strategy estimates the rest.
			l, ok := c.load[h.Shard]
			if known = known && ok; known {
				load = append(load, l)
			}
		}
		view[i].Shards, view[i].Load = shards, load
	}
	return view
}

// holds says whether a row counts as its region's in the strategy's view:
// active, binding to it, or pausing on it for a handoff.
func holds(rec protocol.ShardRecord) bool {
	return rec.State == protocol.StateActive || rec.State == protocol.StateBinding || rec.State == protocol.StateHandoff
}

// placeInView adds shard sh, just bound, to its region in view, where
// strategyView would put it now (oldest allocation first, its load where
// the known prefix reaches it), so that one view serves a whole
// allocation instead of one walk of the table per shard.
func (c *Core) placeInView(view []strategies.Region, sh int) {
	rec := c.table[sh]
	i, ok := slices.BinarySearchFunc(view, rec.Region, func(r strategies.Region, id string) int { return strings.Compare(r.ID, id) })
	if !ok {
		return
	}
	r := &view[i]
	pos, _ := slices.BinarySearchFunc(r.Shards, rec, func(s int, rec protocol.ShardRecord) int {
		return cmp.Or(cmp.Compare(c.table[s].Order, rec.Order), cmp.Compare(s, rec.Shard))
	})
	r.Shards = slices.Insert(r.Shards, pos, sh)
	if pos <= len(r.Load) {
		if l, known := c.load[sh]; known {
			r.Load = slices.Insert(r.Load, pos, l)
		} else {
			r.Load = r.Load[:pos]
		}
	}
}

// regionsChanged sorts the region IDs again after a region came or went.
func (c *Core) regionsChanged() { c.ids = slices.Sorted(maps.Keys(c.regions)) }

// sortedRegionIDs is the IDs of the live regions, sorted. The slice is
// replaced, never changed, when a region comes or goes, so a loop over it
// may add or remove regions; callers must not modify it.
func (c *Core) sortedRegionIDs() []string { return c.ids }

func (c *Core) flush() []Action {
	out := c.out
	c.out = nil
	return out
}
