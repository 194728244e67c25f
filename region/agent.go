package region

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nuid"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// Defaults of Config.
const (
	DefaultIdleTimeout = 120 * time.Second
	DefaultLeaseTTL    = 4 * time.Second
)

// ErrClosed is returned by an Agent that was closed.
var ErrClosed = errors.New("region: closed")

// Config configures an Agent.
type Config struct {
	Conn     *nats.Conn
	Store    *kvstate.Store
	Subjects protocol.Subjects
	Shards   int    // shard count of the type, as stored in KV
	ID       string // region id, unique per process
	Version  string // application version (for rolling updates)
	Factory  Factory
	// IdleTimeout passivates entities idle this long (default 120s;
	// negative: never).
	IdleTimeout time.Duration
	// LeaseTTL of the registration; renewed every LeaseTTL/4. The region
	// stops serving when it could not renew for 3/4 of it (self-fencing).
	LeaseTTL time.Duration
	Logger   *slog.Logger
}

// Agent hosts one type's region in this process: it registers, obeys the
// coordinator and dispatches messages to entities. Create it with Open and
// end it with Close.
type Agent struct {
	cfg  Config
	log  *slog.Logger
	host *host

	gates []gate // per shard: whether messages are dispatched

	mu          sync.Mutex // guards what follows
	subs        map[int]*nats.Subscription
	incarnation string
	started     int64 // unix ms of the current incarnation's registration
	lease       kvstate.Lease
	registered  bool
	renewedAt   time.Time // when the last successful registration write was sent
	maxEpoch    uint64
	closed      bool

	cmdSub *nats.Subscription
	stats  Stats
	limit  logLimiter
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// Stats are counters of an Agent. Read them with Agent.Stats.
type Stats struct {
	Delivered atomic.Uint64 // messages handed to entities
	Malformed atomic.Uint64 // malformed subjects or wrong shard
	NotOwned  atomic.Uint64 // messages for a shard this region no longer serves
	Refused   atomic.Uint64 // commands refused (stale epoch, other incarnation, garbage)
}

// Open registers the region and starts serving commands. It returns when
// the region is registered, or with the error that prevented it.
func Open(ctx context.Context, cfg Config) (*Agent, error) {
	if cfg.Conn == nil || cfg.Store == nil || cfg.Factory == nil || cfg.Shards <= 0 {
		return nil, errors.New("region: Conn, Store, Factory and Shards are required")
	}
	if err := protocol.ValidateName("region id", cfg.ID); err != nil {
		return nil, err
	}
	if cfg.IdleTimeout == 0 {
		cfg.IdleTimeout = DefaultIdleTimeout
	}
	if cfg.LeaseTTL <= 0 {
		cfg.LeaseTTL = DefaultLeaseTTL
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	a := &Agent{
		cfg:   cfg,
		log:   cfg.Logger.With("component", "region", "region", cfg.ID),
		gates: make([]gate, cfg.Shards),
		subs:  make(map[int]*nats.Subscription),
	}
	idle := cfg.IdleTimeout
	if idle < 0 {
		idle = 0
	}
	a.host = newHost(hostConfig{Factory: cfg.Factory, IdleTimeout: idle, Logger: a.log, Reply: a.reply})
	if err := a.register(ctx); err != nil {
		return nil, err
	}
	sub, err := cfg.Conn.Subscribe(cfg.Subjects.Region(cfg.ID), a.onCommand)
	if err != nil {
		return nil, fmt.Errorf("region: subscribe to commands: %w", err)
	}
	a.cmdSub = sub
	if err := cfg.Conn.Flush(); err != nil {
		return nil, fmt.Errorf("region: %w", err)
	}
	lctx, cancel := context.WithCancel(context.Background())
	a.cancel = cancel
	a.wg.Add(2)
	go a.leaseLoop(lctx)
	go a.passivationLoop(lctx)
	a.log.Info("region registered", "incarnation", a.incarnation)
	return a, nil
}

// ID is the region's id.
func (a *Agent) ID() string { return a.cfg.ID }

// Held returns the shards the region serves, ascending.
func (a *Agent) Held() []int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.heldLocked()
}

func (a *Agent) heldLocked() []int {
	held := make([]int, 0, len(a.subs))
	for s := range a.subs {
		held = append(held, s)
	}
	slices.Sort(held)
	return held
}

// Stats returns the agent's counters.
func (a *Agent) Stats() *Stats { return &a.stats }

// Active returns how many entities the region holds.
func (a *Agent) Active() int { return a.host.active() }

// register writes a new registration with a new incarnation. A region
// starts every incarnation holding no shard.
func (a *Agent) register(ctx context.Context) error {
	inc, started := nuid.Next(), time.Now().UnixMilli()
	info := protocol.RegionInfo{ID: a.cfg.ID, Incarnation: inc, Version: a.cfg.Version, Started: started}
	sent := time.Now()
	lease, err := a.cfg.Store.RegisterRegion(ctx, info, a.cfg.LeaseTTL)
	if err != nil {
		return fmt.Errorf("region: register %s: %w", a.cfg.ID, err)
	}
	a.mu.Lock()
	a.incarnation, a.started, a.lease, a.renewedAt, a.registered = inc, started, lease, sent, true
	a.mu.Unlock()
	return nil
}

func (a *Agent) info() protocol.RegionInfo {
	return protocol.RegionInfo{ID: a.cfg.ID, Incarnation: a.incarnation, Version: a.cfg.Version, Started: a.started}
}

// leaseLoop renews the registration, fences the region when it cannot, and
// registers a new incarnation after a fence.
func (a *Agent) leaseLoop(ctx context.Context) {
	defer a.wg.Done()
	t := time.NewTicker(a.cfg.LeaseTTL / 4)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		a.mu.Lock()
		registered, lease, info, renewedAt := a.registered, a.lease, a.info(), a.renewedAt
		a.mu.Unlock()
		if !registered {
			if err := a.register(ctx); err != nil {
				a.log.Warn("cannot register; retrying", "err", err)
			} else {
				a.log.Info("registered as a new incarnation", "incarnation", a.incarnation)
			}
			continue
		}
		sent := time.Now()
		next, err := a.cfg.Store.Renew(ctx, lease, info)
		switch {
		case err == nil:
			a.mu.Lock()
			if a.registered && a.incarnation == info.Incarnation {
				a.lease, a.renewedAt = next, sent
			}
			a.mu.Unlock()
		case errors.Is(err, kvstate.ErrConflict):
			a.Fence("registration lost (removed by the coordinator, or taken over)")
		case time.Since(renewedAt) > a.cfg.LeaseTTL*3/4:
			a.Fence(fmt.Sprintf("cannot renew the registration in time: %v", err))
		default:
			a.log.Warn("registration renewal failed; will retry", "err", err)
		}
	}
}

func (a *Agent) passivationLoop(ctx context.Context) {
	defer a.wg.Done()
	if a.cfg.IdleTimeout <= 0 {
		return
	}
	every := min(max(a.cfg.IdleTimeout/10, 100*time.Millisecond), 10*time.Second)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if n := a.host.passivateIdle(); n > 0 {
				a.log.Debug("passivated idle entities", "count", n)
			}
		}
	}
}

// Fence stops serving every shard at once and forgets the registration;
// the lease loop registers a new incarnation, which starts with no shard.
// The region fences itself when its registration is lost or cannot be
// renewed in time, and the process calls Fence when its NATS connection
// drops, so that a region cut off from NATS never serves a shard that the
// coordinator may have given to another.
func (a *Agent) Fence(reason string) {
	a.mu.Lock()
	if !a.registered {
		a.mu.Unlock()
		return
	}
	a.registered = false
	dropped := a.unbindLocked(a.heldLocked())
	a.mu.Unlock()
	a.log.Warn("fenced: stopped serving every shard", "reason", reason, "shards", len(dropped))
	a.stopEntities(dropped)
}

// unbindLocked stops dispatching and unsubscribes the shards; a.mu is held.
func (a *Agent) unbindLocked(shards []int) []int {
	var done []int
	for _, s := range shards {
		sub, ok := a.subs[s]
		if !ok {
			continue
		}
		a.gates[s].set(false)
		_ = sub.Unsubscribe()
		delete(a.subs, s)
		done = append(done, s)
	}
	return done
}

// stopEntities stops the entities of dropped shards in the background.
func (a *Agent) stopEntities(shards []int) {
	if len(shards) == 0 {
		return
	}
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		for _, s := range shards {
			if err := a.host.stopShard(ctx, s); err != nil {
				a.log.Warn("stopping a shard's entities", "shard", s, "err", err)
			}
		}
	}()
}

// onCommand handles a coordinator command. It runs on the command
// subscription's goroutine, so commands are handled one at a time.
func (a *Agent) onCommand(m *nats.Msg) {
	var cmd protocol.Command
	err := protocol.Decode(m.Data, &cmd)
	if err == nil {
		err = cmd.Validate(a.cfg.Shards)
	}
	if err != nil {
		a.stats.Refused.Add(1)
		a.limit.log(a.log, "bad-command", "refused a malformed command", "err", err)
		a.answer(m, protocol.Reply{Error: err.Error()})
		return
	}
	a.mu.Lock()
	reply := protocol.Reply{Incarnation: a.incarnation}
	switch {
	case a.closed:
		reply.Error = "region is closing"
	case !a.registered:
		reply.Error = "region is not registered"
	case cmd.Epoch < a.maxEpoch:
		reply.Error = fmt.Sprintf("stale epoch %d: have seen %d", cmd.Epoch, a.maxEpoch)
	case cmd.Incarnation != a.incarnation:
		reply.Error = fmt.Sprintf("command for incarnation %s, this is %s", cmd.Incarnation, a.incarnation)
	}
	if reply.Error != "" {
		reply.Epoch = a.maxEpoch
		a.mu.Unlock()
		a.stats.Refused.Add(1)
		a.limit.log(a.log, "refused-command", "refused a command", "kind", cmd.Kind, "epoch", cmd.Epoch, "why", reply.Error)
		a.answer(m, reply)
		return
	}
	a.maxEpoch = cmd.Epoch
	reply.Epoch = cmd.Epoch
	var dropped []int
	switch cmd.Kind {
	case protocol.CmdBind:
		err = a.bindLocked(cmd.Shards)
	case protocol.CmdDrop:
		dropped = a.unbindLocked(cmd.Shards)
	}
	reply.Held = a.heldLocked()
	a.mu.Unlock()
	if err != nil {
		reply.Error = err.Error()
	}
	if len(dropped) > 0 {
		a.log.Info("dropped shards", "shards", dropped, "epoch", cmd.Epoch)
		a.stopEntities(dropped)
	}
	a.answer(m, reply)
}

// bindLocked subscribes to the shards' subjects; a.mu is held. It flushes
// so that the server knows the subscriptions before the coordinator hears
// that they exist.
func (a *Agent) bindLocked(shards []int) error {
	var added []int
	for _, s := range shards {
		if _, ok := a.subs[s]; ok {
			continue
		}
		shard := s
		sub, err := a.cfg.Conn.Subscribe(a.cfg.Subjects.Shard(shard), func(m *nats.Msg) { a.onMessage(shard, m) })
		if err != nil {
			return fmt.Errorf("subscribe shard %d: %w", shard, err)
		}
		_ = sub.SetPendingLimits(-1, -1) // never drop on a slow entity: the mailbox absorbs bursts
		a.subs[shard] = sub
		a.gates[shard].set(true)
		added = append(added, shard)
	}
	if len(added) == 0 {
		return nil
	}
	if err := a.cfg.Conn.Flush(); err != nil {
		return fmt.Errorf("flush subscriptions: %w", err)
	}
	a.log.Info("bound shards", "shards", added)
	return nil
}

func (a *Agent) answer(m *nats.Msg, r protocol.Reply) {
	if m.Reply == "" {
		return
	}
	data, err := protocol.Encode(r)
	if err == nil {
		err = m.Respond(data)
	}
	if err != nil {
		a.log.Debug("cannot answer a command", "err", err)
	}
}

// onMessage dispatches a data-plane message of shard to its entity. It runs
// on the shard subscription's goroutine, so messages of a shard reach the
// host in arrival order.
func (a *Agent) onMessage(shard int, m *nats.Msg) {
	_, id, err := a.cfg.Subjects.ParseEntity(m.Subject, a.cfg.Shards)
	if err != nil {
		a.stats.Malformed.Add(1)
		a.limit.log(a.log, "malformed", "dropped a malformed message", "subject", m.Subject, "err", err)
		a.reply(m, nil, err)
		return
	}
	g := &a.gates[shard]
	g.mu.RLock()
	if g.serving {
		// Under the gate's read lock: once unbind has closed the gate, no
		// message of the shard reaches the host, so stopShard is final.
		a.host.deliver(shard, id, m)
		g.mu.RUnlock()
		a.stats.Delivered.Add(1)
		return
	}
	g.mu.RUnlock()
	a.stats.NotOwned.Add(1)
	a.limit.log(a.log, "not-owned", "dropped a message for a shard not served here", "shard", shard)
	a.reply(m, nil, fmt.Errorf("shard %d is not served by region %s", shard, a.cfg.ID))
}

// gate says whether a shard's messages are dispatched. Closing it waits for
// a dispatch in progress, so after set(false) returns none is under way.
type gate struct {
	mu      sync.RWMutex
	serving bool
}

func (g *gate) set(serving bool) {
	g.mu.Lock()
	g.serving = serving
	g.mu.Unlock()
}

// reply answers a request; err becomes the Natshard-Error header. Plain
// publishes get no answer.
func (a *Agent) reply(m *nats.Msg, data []byte, err error) {
	if m.Reply == "" {
		return
	}
	if err == nil {
		_ = a.cfg.Conn.Publish(m.Reply, data)
		return
	}
	out := nats.NewMsg(m.Reply)
	out.Header.Set(protocol.HeaderError, err.Error())
	out.Data = data
	if out.Data == nil {
		out.Data, _ = json.Marshal(map[string]any{"ok": false, "error": err.Error()})
	}
	_ = a.cfg.Conn.PublishMsg(out)
}

// Close stops serving: it unsubscribes every shard, stops their entities
// (running their stop hooks), deregisters and returns. The connection is
// left to the caller. Messages published to the region's shards until the
// coordinator re-homes them are not delivered.
func (a *Agent) Close(ctx context.Context) error {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return ErrClosed
	}
	a.closed = true
	held := a.unbindLocked(a.heldLocked())
	lease, registered := a.lease, a.registered
	a.registered = false
	a.mu.Unlock()
	_ = a.cmdSub.Unsubscribe()
	a.cancel()
	err := a.host.stopAll(ctx)
	a.wg.Wait()
	if registered {
		if rerr := a.cfg.Store.Release(ctx, lease); rerr != nil && !errors.Is(rerr, kvstate.ErrConflict) {
			err = errors.Join(err, fmt.Errorf("region: deregister: %w", rerr))
		}
	}
	a.log.Info("region closed", "shards", len(held))
	return err
}

// logLimiter logs each kind of repeated problem at most once per interval,
// with the number of occurrences since the last line.
type logLimiter struct {
	mu   sync.Mutex
	last map[string]time.Time
	n    map[string]int
}

const logEvery = 10 * time.Second

func (l *logLimiter) log(log *slog.Logger, kind, msg string, args ...any) {
	l.mu.Lock()
	if l.last == nil {
		l.last, l.n = map[string]time.Time{}, map[string]int{}
	}
	l.n[kind]++
	now := time.Now()
	if now.Sub(l.last[kind]) < logEvery {
		l.mu.Unlock()
		return
	}
	count := l.n[kind]
	l.last[kind], l.n[kind] = now, 0
	l.mu.Unlock()
	log.Warn(msg, append(args, "occurrences", count)...)
}
