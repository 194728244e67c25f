package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
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
	DefaultLeaseTTL          = 4 * time.Second
	DefaultTick              = 100 * time.Millisecond
	DefaultCommandTimeout    = 2 * time.Second
	DefaultHandOffTimeout    = 10 * time.Second
	DefaultRebalanceInterval = 2 * time.Second
	DefaultMaxMoves          = 16
	DefaultReleaseGrace      = time.Second
)

// Config configures a Node.
type Config struct {
	Conn     *nats.Conn
	Store    *kvstate.Store
	Buffer   *kvstate.Buffer // where parked shards' messages wait
	Subjects protocol.Subjects
	Shards   int
	// Region is the id of the process this candidate runs in (for display).
	Region     string
	Strategy   strategies.Strategy // default least-shard with Akka's limits
	MinRegions int
	// LeaseTTL of the coordinator lease; renewed every LeaseTTL/4.
	LeaseTTL       time.Duration
	Tick           time.Duration // one core tick
	CommandTimeout time.Duration // bound on each command to a region
	// HandOffTimeout: how long a source may take to pause a shard.
	HandOffTimeout time.Duration
	// RebalanceInterval between strategy rounds; negative disables them.
	RebalanceInterval time.Duration
	MaxMoves          int           // moves of live shards in flight
	ReleaseGrace      time.Duration // unpark: keep diverting this long first; 0 means the default, negative none
	Logger            *slog.Logger
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
	if c.RebalanceInterval == 0 {
		c.RebalanceInterval = DefaultRebalanceInterval
	}
	if c.MaxMoves <= 0 {
		c.MaxMoves = DefaultMaxMoves
	}
	if c.ReleaseGrace == 0 {
		c.ReleaseGrace = DefaultReleaseGrace
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
}

// Node is a coordinator candidate. Run campaigns for the type's coordinator
// lease and, while it holds it, makes the decisions of the Core and carries
// them out over NATS. Every shardd runs one unless told not to.
type Node struct {
	cfg Config
	log *slog.Logger
}

// New returns a candidate; it does nothing until Run.
func New(cfg Config) *Node {
	cfg.setDefaults()
	return &Node{cfg: cfg, log: cfg.Logger.With("component", "coordinator")}
}

// Run campaigns and leads until ctx ends; then it releases the lease if it
// holds it and returns nil. It returns an error only for a configuration it
// cannot work with.
func (n *Node) Run(ctx context.Context) error {
	if n.cfg.Conn == nil || n.cfg.Store == nil || n.cfg.Buffer == nil || n.cfg.Shards <= 0 {
		return errors.New("coordinator: Conn, Store, Buffer and Shards are required")
	}
	for ctx.Err() == nil {
		info := protocol.CoordinatorInfo{Region: n.cfg.Region, Incarnation: nuid.Next(), Since: time.Now().UnixMilli()}
		sent := time.Now()
		lease, err := n.cfg.Store.AcquireCoordinator(ctx, info, n.cfg.LeaseTTL)
		switch {
		case err == nil:
			n.log.Info("took the coordinator lease", "epoch", lease.Revision)
			info.Epoch = lease.Revision
			if !time.Now().Before(renewal.Deadline(sent, n.cfg.LeaseTTL)) {
				// Acknowledged so late that the rule counts the lease
				// expired already: renew it before leading.
				sent = time.Now()
				if lease, err = n.cfg.Store.Renew(ctx, lease, info); err != nil {
					n.log.Warn("took the coordinator lease too late to lead, and cannot renew it", "err", err)
					continue
				}
			}
			l := &leader{Node: n, info: info, lease: lease, renewedAt: sent}
			l.run(ctx)
		case errors.Is(err, kvstate.ErrConflict):
			n.waitForVacancy(ctx)
		default:
			n.log.Warn("cannot campaign for the coordinator lease", "err", err)
			wait.Sleep(ctx, time.Second)
		}
	}
	return nil
}

// waitForVacancy returns when the lease looks free (released or expired),
// after LeaseTTL/2 at the latest, or when ctx ends.
func (n *Node) waitForVacancy(ctx context.Context) {
	wctx, cancel := context.WithTimeout(ctx, n.cfg.LeaseTTL/2)
	defer cancel()
	events, err := n.cfg.Store.WatchCoordinator(wctx)
	if err != nil {
		<-wctx.Done()
		return
	}
	for ev := range events {
		if !ev.Synced && ev.Info == nil {
			return
		}
	}
}

// leader is one term of leadership: from taking the lease to losing or
// releasing it. Only its run goroutine touches core and lease.
type leader struct {
	*Node
	info      protocol.CoordinatorInfo
	lease     kvstate.Lease
	renewedAt time.Time // when the last successful renewal was sent
	core      *Core
	events    chan Event // command outcomes, unparks and marks, from other goroutines
	admin     chan *nats.Msg
	parker    *parker
	seen      map[string]protocol.RegionInfo // regions as last announced on the events subject
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
	epoch := l.lease.Revision
	table, err := l.cfg.Store.Shards(ctx)
	if err != nil {
		return fmt.Errorf("read shard table: %w", err)
	}
	entries, err := l.cfg.Store.Regions(ctx)
	if err != nil {
		return fmt.Errorf("read regions: %w", err)
	}
	regions := make([]RegionSeen, len(entries))
	for i, e := range entries {
		regions[i] = RegionSeen{Info: e.Info, Revision: e.Revision}
	}
	pins, err := l.cfg.Store.Pins(ctx)
	if err != nil {
		return fmt.Errorf("read pins: %w", err)
	}
	ticks := func(d time.Duration) int { return max(1, int(d/l.cfg.Tick)) }
	rebalance := -1
	if l.cfg.RebalanceInterval > 0 {
		rebalance = ticks(l.cfg.RebalanceInterval)
	}
	core, acts := NewCore(CoreConfig{
		Shards: l.cfg.Shards, Strategy: l.cfg.Strategy, MinRegions: l.cfg.MinRegions,
		ProbeEvery: ticks(500 * time.Millisecond), Retry: ticks(time.Second),
		HandOffTimeout: ticks(l.cfg.HandOffTimeout), RebalanceEvery: rebalance, MaxMoves: l.cfg.MaxMoves,
		Pins: pins,
	}, l.cfg.Region, epoch, table, regions)
	l.core = core
	l.events = make(chan Event, 1024)
	l.admin = make(chan *nats.Msg, 16)
	l.parker = newParker(l.cfg.Conn, l.cfg.Buffer, l.cfg.Subjects, l.log)
	defer l.parker.stop()
	l.log.Info("leading", "epoch", epoch, "regions", len(regions), "rows", len(table), "pins", len(pins))
	l.seen = map[string]protocol.RegionInfo{}
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
	watch := l.watchRegions(ctx)
	tick := time.NewTicker(l.cfg.Tick)
	defer tick.Stop()
	renew := time.NewTimer(renewal.Wait(l.renewedAt, l.cfg.LeaseTTL, false, time.Now()))
	defer renew.Stop()
	for {
		var acts []Action
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-renew.C:
			renewed, err := l.renew(ctx)
			if err != nil {
				return err
			}
			renew.Reset(renewal.Wait(l.renewedAt, l.cfg.LeaseTTL, !renewed, time.Now()))
		case ev, ok := <-watch:
			if !ok {
				watch = l.watchRegions(ctx)
				continue
			}
			acts = core.Step(ev)
		case ev := <-l.events:
			acts = core.Step(ev)
		case <-tick.C:
			acts = core.Tick()
		case m := <-l.admin:
			if err := l.answerAdmin(ctx, m); err != nil {
				return err
			}
		}
		l.announceRegions() // before the moves that a change of regions starts
		if err := l.execute(ctx, acts); err != nil {
			return err
		}
	}
}

// renew extends the lease and reports whether it did. A lost lease ends
// the term at once (the error); an unreachable server ends it when the
// lease may have expired (package renewal).
func (l *leader) renew(ctx context.Context) (bool, error) {
	sent := time.Now()
	stepDownAt := renewal.Deadline(l.renewedAt, l.cfg.LeaseTTL)
	rctx, cancel := context.WithDeadline(ctx, stepDownAt)
	lease, err := l.cfg.Store.Renew(rctx, l.lease, l.info)
	cancel()
	if err == nil {
		l.lease, l.renewedAt = lease, sent
		return true, nil
	}
	if errors.Is(err, kvstate.ErrConflict) {
		return false, fmt.Errorf("%w: lease lost: %w", errStepDown, err)
	}
	if !time.Now().Before(stepDownAt) {
		return false, fmt.Errorf("%w: cannot renew the lease in time: %w", errStepDown, err)
	}
	l.log.Warn("lease renewal failed; will retry", "err", err)
	return false, nil
}

// execute carries out actions in order. Table writes are synchronous and
// fenced: a refused write ends the term. Commands run concurrently and
// report back through l.results.
func (l *leader) execute(ctx context.Context, acts []Action) error {
	var unparks []Unpark
	for _, a := range acts {
		switch a := a.(type) {
		case WriteShard:
			if _, err := l.cfg.Store.PutShard(ctx, l.lease, a.Record); err != nil {
				return fmt.Errorf("%w: write shard %d: %w", errStepDown, a.Record.Shard, err)
			}
			l.log.Debug("shard", "shard", a.Record.Shard, "region", a.Record.Region, "state", a.Record.State)
			l.publish(protocol.Event{Kind: protocol.EventShard, Shard: &a.Record.Shard, State: string(a.Record.State), Region: a.Record.Region, Source: a.Record.Source})
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
			l.log.Warn("region found dead: no responders on its command subject", "region", a.ID)
			if err := l.cfg.Store.RemoveRegion(ctx, a.ID, a.Revision); err != nil && !errors.Is(err, kvstate.ErrConflict) {
				l.log.Warn("cannot remove dead region's registration", "region", a.ID, "err", err)
			}
		case StepDown:
			return fmt.Errorf("%w: %s", errStepDown, a.Reason)
		case Park:
			if err := l.parker.park(a.Shard, a.Handoff); err != nil {
				return fmt.Errorf("%w: park shard %d: %w", errStepDown, a.Shard, err)
			}
		case Unpark:
			unparks = append(unparks, a)
		case Mark:
			go l.mark(ctx, a)
		case Warn:
			l.log.Warn(a.Msg)
		}
	}
	if len(unparks) > 0 {
		go l.unpark(ctx, unparks)
	}
	return nil
}

// unpark ends the parking of shards whose new owner is replaying their
// buffer: after the grace period (so that the owner's subscription is known
// to every server of a cluster), it unsubscribes and appends the end
// markers, then reports each shard Unparked.
func (l *leader) unpark(ctx context.Context, us []Unpark) {
	wait.Sleep(ctx, l.cfg.ReleaseGrace)
	for _, u := range us {
		l.parker.unsubscribe(u.Shard, u.Handoff)
	}
	for _, u := range us {
		if l.markRetrying(ctx, u.Shard, u.Handoff) {
			l.post(ctx, Unparked(u))
		}
	}
}

// mark appends an end marker for a source that died.
func (l *leader) mark(ctx context.Context, m Mark) {
	if l.markRetrying(ctx, m.Shard, m.Handoff) {
		l.post(ctx, Marked(m))
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
		body = protocol.AdminError{Error: err.Error()}
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

// announceRegions publishes the regions that registered, started leaving
// or are gone since the last call.
func (l *leader) announceRegions() {
	now := map[string]protocol.RegionInfo{}
	for _, r := range l.core.Regions() {
		now[r.Info.ID] = r.Info
		old, ok := l.seen[r.Info.ID]
		switch {
		case ok && old.Incarnation != r.Info.Incarnation:
			// The process behind the id restarted.
			l.publish(protocol.Event{Kind: protocol.EventRegionGone, Region: r.Info.ID})
			fallthrough
		case !ok:
			l.publish(protocol.Event{Kind: protocol.EventRegionUp, Region: r.Info.ID})
			if r.Info.Leaving {
				l.publish(protocol.Event{Kind: protocol.EventLeaving, Region: r.Info.ID})
			}
		case r.Info.Leaving && !old.Leaving:
			l.publish(protocol.Event{Kind: protocol.EventLeaving, Region: r.Info.ID})
		}
	}
	for _, id := range slices.Sorted(maps.Keys(l.seen)) {
		if _, ok := now[id]; !ok {
			l.publish(protocol.Event{Kind: protocol.EventRegionGone, Region: id})
		}
	}
	l.seen = now
}

func (l *leader) status() protocol.Status {
	st := protocol.Status{
		Type:        l.cfg.Subjects.Type(),
		Shards:      l.cfg.Shards,
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
