package coordinator

import (
	"cmp"
	"fmt"
	"slices"

	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/strategies"
)

// CoreConfig configures a Core. Times are counted in ticks.
type CoreConfig struct {
	Shards   int                 // shard count of the type
	Strategy strategies.Strategy // where unowned shards go
	// MinRegions: no shard is allocated until this many regions are
	// registered (Akka's min-nr-of-members). 0 or 1 allocates at once.
	MinRegions int
	// ProbeEvery: ticks between probes of each region (default 5).
	ProbeEvery int
	// BindRetry: ticks after which an unconfirmed Bind is sent again
	// (default 20).
	BindRetry int
}

// Core is the coordinator's decision logic for one epoch: it owns the
// shard table and the view of live regions, takes events and ticks, and
// returns the actions to carry out. It does no I/O and reads no clock, so
// the same inputs give the same outputs. It is not safe for concurrent use.
type Core struct {
	cfg     CoreConfig
	self    string
	epoch   uint64
	tick    int
	regions map[string]*regionState
	table   []protocol.ShardRecord // index is the shard number
	order   uint64                 // largest allocation order in the table
	started bool                   // MinRegions was reached once (or the table had owners)
	bindAt  []int                  // tick of the last Bind sent per shard
	out     []Action
}

type regionState struct {
	RegionSeen
	probedAt int
}

// NewCore starts the decisions of the coordinator that holds epoch, with the
// shard table and the registered regions read at takeover. Rows of table
// may be missing or out of order. The returned actions reconcile what was
// read: shards of regions that are gone are reallocated, unconfirmed binds
// are sent again, every region is probed.
func NewCore(cfg CoreConfig, self string, epoch uint64, table []protocol.ShardRecord, regions []RegionSeen) (*Core, []Action) {
	if cfg.ProbeEvery <= 0 {
		cfg.ProbeEvery = 5
	}
	if cfg.BindRetry <= 0 {
		cfg.BindRetry = 20
	}
	c := &Core{
		cfg:     cfg,
		self:    self,
		epoch:   epoch,
		regions: make(map[string]*regionState),
		table:   make([]protocol.ShardRecord, cfg.Shards),
		bindAt:  make([]int, cfg.Shards),
	}
	for i := range c.table {
		c.table[i] = protocol.ShardRecord{Shard: i, State: protocol.StateUnowned}
	}
	for _, r := range table {
		if r.Shard >= 0 && r.Shard < cfg.Shards {
			c.table[r.Shard] = r
			c.order = max(c.order, r.Order)
			c.started = c.started || r.Region != ""
		}
	}
	for _, r := range regions {
		c.regions[r.Info.ID] = &regionState{RegionSeen: r}
	}
	for i := range c.table {
		if c.table[i].Region != "" && !c.owns(i) {
			c.unown(i)
		}
	}
	c.resendBinds(true)
	c.probeAll()
	c.allocate()
	return c, c.flush()
}

// Epoch is the epoch this core decides for.
func (c *Core) Epoch() uint64 { return c.epoch }

// Table returns a copy of the shard table.
func (c *Core) Table() []protocol.ShardRecord { return slices.Clone(c.table) }

// Regions returns the live regions, by ID.
func (c *Core) Regions() []RegionSeen {
	out := make([]RegionSeen, 0, len(c.regions))
	for _, r := range c.regions {
		out = append(out, r.RegionSeen)
	}
	slices.SortFunc(out, func(a, b RegionSeen) int { return cmp.Compare(a.Info.ID, b.Info.ID) })
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
	case CommandDone:
		c.commandDone(ev)
	}
	return c.flush()
}

// Tick advances logical time by one tick: probes regions that are due and
// sends again binds that were not confirmed in time.
func (c *Core) Tick() []Action {
	c.tick++
	for _, id := range c.sortedRegionIDs() {
		r := c.regions[id]
		if c.tick-r.probedAt >= c.cfg.ProbeEvery {
			c.probe(r)
		}
	}
	c.resendBinds(false)
	c.allocate()
	return c.flush()
}

func (c *Core) regionUp(seen RegionSeen) {
	id := seen.Info.ID
	if old, ok := c.regions[id]; ok {
		if old.Info.Incarnation == seen.Info.Incarnation {
			old.RegionSeen = seen
			return
		}
		// A new incarnation under the same id: the old one's shards are gone.
		c.regionGone(id)
	}
	c.regions[id] = &regionState{RegionSeen: seen, probedAt: c.tick}
	c.allocate()
}

// regionGone forgets a region and makes its shards unowned, then
// reallocates them.
func (c *Core) regionGone(id string) {
	r, ok := c.regions[id]
	if !ok {
		return
	}
	delete(c.regions, id)
	for i := range c.table {
		if c.table[i].Region == id && c.table[i].Incarnation == r.Info.Incarnation {
			c.unown(i)
		}
	}
	c.allocate()
}

func (c *Core) commandDone(ev CommandDone) {
	s := ev.Send
	r, ok := c.regions[s.Region]
	if !ok || r.Info.Incarnation != s.Command.Incarnation {
		return // about a region or incarnation that is gone: nothing to do
	}
	switch ev.Outcome {
	case NoResponders:
		c.out = append(c.out, RemoveRegion{ID: s.Region, Revision: r.Revision})
		c.regionGone(s.Region)
		return
	case Failed:
		return // binds are sent again by Tick; probes are repeated anyway
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
		return
	}
	switch s.Command.Kind {
	case protocol.CmdBind:
		for _, sh := range s.Command.Shards {
			rec := c.table[sh]
			if rec.Region == s.Region && rec.Incarnation == r.Info.Incarnation && rec.State == protocol.StateAllocating {
				rec.State = protocol.StateActive
				rec.Epoch = c.epoch
				c.write(rec)
			}
		}
	case protocol.CmdProbe:
		c.reconcile(r, ev.Reply.Held)
	}
}

// reconcile compares what a region says it holds with the table: shards it
// should hold but does not are bound again; shards it holds but should not
// are dropped.
func (c *Core) reconcile(r *regionState, held []int) {
	has := make(map[int]bool, len(held))
	var drop []int
	for _, sh := range held {
		if sh < 0 || sh >= c.cfg.Shards {
			continue
		}
		has[sh] = true
		if !c.ownedBy(sh, r) {
			drop = append(drop, sh)
		}
	}
	var bind []int
	for i := range c.table {
		if c.ownedBy(i, r) && !has[i] {
			bind = append(bind, i)
			c.bindAt[i] = c.tick
		}
	}
	if len(drop) > 0 {
		c.send(r, protocol.CmdDrop, drop)
	}
	if len(bind) > 0 {
		c.send(r, protocol.CmdBind, bind)
	}
}

// allocate gives every unowned shard to a region chosen by the strategy.
// The first allocation waits for MinRegions; later ones (re-homing) do not.
func (c *Core) allocate() {
	c.started = c.started || len(c.regions) >= c.cfg.MinRegions
	if len(c.regions) == 0 || !c.started {
		return
	}
	var view []strategies.Region
	index := map[string]int{}
	batches := map[string][]int{}
	for sh := range c.table {
		if c.table[sh].Region != "" {
			continue
		}
		if view == nil {
			view = c.strategyView()
			for i, v := range view {
				index[v.ID] = i
			}
		}
		id, err := c.cfg.Strategy.Allocate(sh, "", view)
		r, ok := c.regions[id]
		if err != nil || !ok || r.Info.Leaving {
			continue // no region can take it now; Tick tries again
		}
		c.order++
		c.write(protocol.ShardRecord{
			Shard: sh, Region: id, Incarnation: r.Info.Incarnation,
			State: protocol.StateAllocating, Order: c.order, Epoch: c.epoch,
		})
		view[index[id]].Shards = append(view[index[id]].Shards, sh)
		batches[id] = append(batches[id], sh)
		c.bindAt[sh] = c.tick
	}
	for _, id := range sortedKeys(batches) {
		c.send(c.regions[id], protocol.CmdBind, batches[id])
	}
}

// resendBinds sends Bind again for shards still allocating: all of them
// (at takeover) or those whose last Bind is older than BindRetry ticks.
func (c *Core) resendBinds(all bool) {
	batches := map[string][]int{}
	for sh, rec := range c.table {
		if rec.State != protocol.StateAllocating || !c.owns(sh) {
			continue
		}
		if all || c.tick-c.bindAt[sh] >= c.cfg.BindRetry {
			batches[rec.Region] = append(batches[rec.Region], sh)
			c.bindAt[sh] = c.tick
		}
	}
	for _, id := range sortedKeys(batches) {
		c.send(c.regions[id], protocol.CmdBind, batches[id])
	}
}

func (c *Core) probeAll() {
	for _, id := range c.sortedRegionIDs() {
		c.probe(c.regions[id])
	}
}

func (c *Core) probe(r *regionState) {
	r.probedAt = c.tick
	c.send(r, protocol.CmdProbe, nil)
}

func (c *Core) send(r *regionState, kind protocol.CommandKind, shards []int) {
	c.out = append(c.out, Send{Region: r.Info.ID, Command: protocol.Command{
		Kind: kind, Epoch: c.epoch, Coordinator: c.self, Incarnation: r.Info.Incarnation, Shards: shards,
	}})
}

func (c *Core) write(rec protocol.ShardRecord) {
	c.table[rec.Shard] = rec
	c.out = append(c.out, WriteShard{Record: rec})
}

// unown records shard i as having no owner.
func (c *Core) unown(i int) {
	c.write(protocol.ShardRecord{Shard: i, State: protocol.StateUnowned, Order: c.table[i].Order, Epoch: c.epoch})
}

// owns reports whether shard i's recorded owner is a live region incarnation.
func (c *Core) owns(i int) bool {
	rec := c.table[i]
	r, ok := c.regions[rec.Region]
	return ok && r.Info.Incarnation == rec.Incarnation
}

func (c *Core) ownedBy(i int, r *regionState) bool {
	rec := c.table[i]
	return rec.Region == r.Info.ID && rec.Incarnation == r.Info.Incarnation
}

// strategyView is the regions as the strategy sees them: shards oldest
// allocation first.
func (c *Core) strategyView() []strategies.Region {
	view := make([]strategies.Region, 0, len(c.regions))
	for _, id := range c.sortedRegionIDs() {
		r := c.regions[id]
		var held []protocol.ShardRecord
		for i := range c.table {
			if c.ownedBy(i, r) {
				held = append(held, c.table[i])
			}
		}
		slices.SortFunc(held, func(a, b protocol.ShardRecord) int {
			return cmp.Or(cmp.Compare(a.Order, b.Order), cmp.Compare(a.Shard, b.Shard))
		})
		shards := make([]int, len(held))
		for i, h := range held {
			shards[i] = h.Shard
		}
		view = append(view, strategies.Region{ID: id, Shards: shards, Version: r.Info.Version, Leaving: r.Info.Leaving})
	}
	return view
}

func (c *Core) sortedRegionIDs() []string { return sortedKeys(c.regions) }

func (c *Core) flush() []Action {
	out := c.out
	c.out = nil
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
