package region

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nuid"
	"github.com/natshard/natshard/internal/renewal"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// Defaults of Config.
const (
	DefaultIdleTimeout  = 120 * time.Second
	DefaultLeaseTTL     = 4 * time.Second
	DefaultReleaseGrace = time.Second
	DefaultHandOffWait  = time.Second
)

// ErrClosed is returned by an Agent that was closed.
var ErrClosed = errors.New("region: closed")

// Config configures an Agent.
type Config struct {
	Conn     *nats.Conn
	Store    *kvstate.Store
	Buffer   *kvstate.Buffer // the type's handoff buffer (required)
	Subjects protocol.Subjects
	Shards   int    // shard count of the type, as stored in KV
	ID       string // region id, unique per process
	Version  string // application version (for rolling updates)
	Factory  Factory
	// IdleTimeout passivates entities idle this long (default 120s;
	// negative: never).
	IdleTimeout time.Duration
	// LeaseTTL of the registration; renewed every LeaseTTL/4, and soon
	// again after a failure (package renewal). The region stops serving
	// when it could not renew for 3/4 of it (self-fencing).
	LeaseTTL time.Duration
	// ReleaseGrace: how long the source of a handoff keeps diverting after
	// Release, so that the interest of the new owner's subscription reaches
	// every server of a cluster. 0 means DefaultReleaseGrace; negative
	// means none, for a standalone server (see shardd's --release-grace).
	ReleaseGrace time.Duration
	// HandOffWait: how long a HandOff command waits for the shards'
	// entities to stop before it answers Complete=false (default 1s).
	HandOffWait time.Duration
	// MaxHeld bounds the messages a binding shard holds while it replays
	// the buffer (default kvstate.DefaultBufferPerShard); beyond it
	// arrivals are refused visibly.
	MaxHeld int
	Logger  *slog.Logger
}

// Agent hosts one type's region in this process: it registers, obeys the
// coordinator and dispatches messages to entities. Create it with Open and
// end it with Leave (optional: hands the shards off) and Close.
type Agent struct {
	cfg Config
	log *slog.Logger
	// traceMsgs: the logger takes debug lines, so the replay logs each
	// message it delivers or skips (checked once: they are many).
	traceMsgs bool
	host      *host

	// ctx lives until Close; the background work (replays, releases,
	// answers that wait) ends with it.
	ctx    context.Context
	cancel context.CancelFunc

	renewMu        sync.Mutex // serializes the writes of the registration, and guards:
	pendingInc     string     // the incarnation being registered (see register)
	pendingStarted int64

	mu          sync.Mutex // guards what follows
	shards      map[int]*shardState
	stopping    map[int]chan struct{} // shard -> closed when its entities have stopped
	incarnation string
	started     int64 // unix ms of the current incarnation's registration
	lease       kvstate.Lease
	registered  bool
	renewedAt   time.Time // when the last successful registration write was sent
	maxEpoch    uint64
	leaving     bool
	closed      bool

	cmdSub   *nats.Subscription
	querySub *nats.Subscription
	meter    loadMeter
	stats    Stats
	limit    logLimiter
	wg       sync.WaitGroup
}

// Stats are counters of an Agent. Read them with Agent.Stats.
type Stats struct {
	Delivered atomic.Uint64 // messages handed to entities (live, replayed or held)
	Malformed atomic.Uint64 // malformed subjects or wrong shard
	NotOwned  atomic.Uint64 // messages for a shard this region no longer serves
	Refused   atomic.Uint64 // commands refused (stale epoch, other incarnation, garbage)

	Buffered          atomic.Uint64 // messages of paused shards given to the buffer (BufferFailed of them were refused)
	BufferFailed      atomic.Uint64 // of those, the ones the buffer refused (full, or an error): lost, answered with an error
	Replayed          atomic.Uint64 // buffered messages replayed to entities
	Held              atomic.Uint64 // arrivals held while their shard's buffer was replayed
	DuplicatesSkipped atomic.Uint64 // copies skipped: a message with their Nats-Msg-Id was delivered since the bind
	HeldOverflow      atomic.Uint64 // arrivals refused while replaying: MaxHeld reached
}

// Open registers the region and starts serving commands. It returns when
// the region is registered, or with the error that prevented it.
func Open(ctx context.Context, cfg Config) (*Agent, error) {
	if cfg.Conn == nil || cfg.Store == nil || cfg.Buffer == nil || cfg.Factory == nil || cfg.Shards <= 0 {
		return nil, errors.New("region: Conn, Store, Buffer, Factory and Shards are required")
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
	if cfg.ReleaseGrace == 0 {
		cfg.ReleaseGrace = DefaultReleaseGrace
	}
	if cfg.HandOffWait <= 0 {
		cfg.HandOffWait = DefaultHandOffWait
	}
	if cfg.MaxHeld <= 0 {
		cfg.MaxHeld = kvstate.DefaultBufferPerShard
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	a := &Agent{
		cfg:      cfg,
		log:      cfg.Logger.With("component", "region", "region", cfg.ID),
		shards:   make(map[int]*shardState),
		stopping: make(map[int]chan struct{}),
	}
	a.traceMsgs = a.log.Enabled(context.Background(), slog.LevelDebug)
	idle := cfg.IdleTimeout
	if idle < 0 {
		idle = 0
	}
	a.host = newHost(hostConfig{Factory: cfg.Factory, IdleTimeout: idle, Logger: a.log, Reply: a.reply})
	err := a.register(ctx)
	for try := 1; errors.Is(err, errLateAck) && try < 3; try++ {
		err = a.register(ctx)
	}
	if err != nil {
		return nil, err
	}
	a.ctx, a.cancel = context.WithCancel(context.Background())
	sub, err := cfg.Conn.Subscribe(cfg.Subjects.Region(cfg.ID), a.onCommand)
	if err != nil {
		a.cancel()
		return nil, fmt.Errorf("region: subscribe to commands: %w", err)
	}
	a.cmdSub = sub
	if a.querySub, err = cfg.Conn.Subscribe(cfg.Subjects.Query(cfg.ID), a.onQuery); err != nil {
		a.cancel()
		_ = sub.Unsubscribe()
		return nil, fmt.Errorf("region: subscribe to queries: %w", err)
	}
	if err := cfg.Conn.Flush(); err != nil {
		a.cancel()
		_ = sub.Unsubscribe()
		_ = a.querySub.Unsubscribe()
		return nil, fmt.Errorf("region: %w", err)
	}
	a.wg.Add(2)
	go a.leaseLoop(a.ctx)
	go a.passivationLoop(a.ctx)
	a.log.Info("region registered", "incarnation", a.incarnation)
	return a, nil
}

// ID is the region's id.
func (a *Agent) ID() string { return a.cfg.ID }

// Held returns the shards the region is subscribed to (serving, replaying
// or diverting), ascending.
func (a *Agent) Held() []int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.heldLocked()
}

func (a *Agent) heldLocked() []int {
	held := make([]int, 0, len(a.shards))
	for s := range a.shards {
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
	a.renewMu.Lock()
	defer a.renewMu.Unlock()
	// A registration whose answer did not come (a timeout, a cut network)
	// may be stored later still: retries reuse its incarnation, so that
	// such a late write does not announce yet another one.
	if a.pendingInc == "" {
		a.pendingInc, a.pendingStarted = nuid.Next(), time.Now().UnixMilli()
	}
	inc, started := a.pendingInc, a.pendingStarted
	a.mu.Lock()
	leaving := a.leaving
	a.mu.Unlock()
	info := protocol.RegionInfo{ID: a.cfg.ID, Incarnation: inc, Version: a.cfg.Version, Leaving: leaving, Started: started}
	sent := time.Now()
	lease, err := a.cfg.Store.RegisterRegion(ctx, info, a.cfg.LeaseTTL)
	if err != nil {
		return fmt.Errorf("region: register %s: %w", a.cfg.ID, err)
	}
	if !time.Now().Before(renewal.Deadline(sent, a.cfg.LeaseTTL)) {
		// Acknowledged so late that the rule counts it expired already:
		// write it again, as the same incarnation.
		return fmt.Errorf("region: register %s: %w (%s after it was sent)", a.cfg.ID, errLateAck, time.Since(sent).Round(time.Millisecond))
	}
	a.pendingInc = ""
	a.mu.Lock()
	a.incarnation, a.started, a.lease, a.renewedAt, a.registered = inc, started, lease, sent, true
	a.mu.Unlock()
	return nil
}

// infoLocked is the registration's value; a.mu is held.
func (a *Agent) infoLocked() protocol.RegionInfo {
	return protocol.RegionInfo{ID: a.cfg.ID, Incarnation: a.incarnation, Version: a.cfg.Version, Leaving: a.leaving, Started: a.started}
}

// errLateAck: a registration was acknowledged after the renewal deadline;
// it is written again.
var errLateAck = errors.New("registration acknowledged too late")

// errNotRegistered: the region has no registration to renew (fenced; the
// lease loop registers a new incarnation).
var errNotRegistered = errors.New("region is not registered")

// renew rewrites the registration with a fresh TTL and the current value
// (leaving or not). It fences the region when the registration was lost,
// or could not be renewed for 3/4 of the TTL. The lease loop and Leave
// both call it; renewMu keeps their compare-and-set writes in order.
func (a *Agent) renew(ctx context.Context) error {
	a.renewMu.Lock()
	defer a.renewMu.Unlock()
	a.mu.Lock()
	registered, lease, info, renewedAt := a.registered, a.lease, a.infoLocked(), a.renewedAt
	a.mu.Unlock()
	if !registered {
		return errNotRegistered
	}
	sent := time.Now()
	fenceAt := renewal.Deadline(renewedAt, a.cfg.LeaseTTL)
	rctx, cancel := context.WithDeadline(ctx, fenceAt)
	next, err := a.cfg.Store.Renew(rctx, lease, info)
	cancel()
	switch {
	case err == nil:
		a.mu.Lock()
		if a.registered && a.incarnation == info.Incarnation {
			a.lease, a.renewedAt = next, sent
		}
		a.mu.Unlock()
	case ctx.Err() != nil:
		// Our own caller gave up (Close): no verdict on the registration.
	case errors.Is(err, kvstate.ErrConflict):
		a.Fence("registration lost (removed by the coordinator, or taken over)")
	case !time.Now().Before(fenceAt):
		a.Fence(fmt.Sprintf("cannot renew the registration in time: %v", err))
	default:
		a.log.Warn("registration renewal failed; will retry", "err", err)
	}
	return err
}

// nextRenewal is how long the lease loop waits before it renews (or
// registers) again.
func (a *Agent) nextRenewal(failed bool) time.Duration {
	a.mu.Lock()
	renewed := a.renewedAt
	a.mu.Unlock()
	return renewal.Wait(renewed, a.cfg.LeaseTTL, failed, time.Now())
}

// leaseLoop renews the registration, fences the region when it cannot, and
// registers a new incarnation after a fence.
func (a *Agent) leaseLoop(ctx context.Context) {
	defer a.wg.Done()
	t := time.NewTimer(a.nextRenewal(false))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		err := a.renew(ctx)
		if !errors.Is(err, errNotRegistered) {
			t.Reset(a.nextRenewal(err != nil))
			continue
		}
		if err := a.register(ctx); err != nil {
			a.log.Warn("cannot register; retrying", "err", err)
			t.Reset(a.nextRenewal(true))
			continue
		}
		t.Reset(a.nextRenewal(false))
		a.mu.Lock()
		inc := a.incarnation
		a.mu.Unlock()
		a.log.Info("registered as a new incarnation", "incarnation", inc)
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
// coordinator may have given to another. Shards being handed off are
// dropped too, without end marker: the coordinator re-homes them as after
// a crash.
func (a *Agent) Fence(reason string) {
	a.mu.Lock()
	if !a.registered {
		a.mu.Unlock()
		return
	}
	a.registered = false
	dropped := a.unbindLocked(a.heldLocked(), "region fenced")
	a.mu.Unlock()
	a.log.Warn("fenced: stopped serving every shard", "reason", reason, "shards", len(dropped))
}

// markLeaving sets the leaving flag; it reports false when the agent is
// closed.
func (a *Agent) markLeaving() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return false
	}
	if !a.leaving {
		a.log.Info("region leaving: waiting for its shards to be handed off")
	}
	a.leaving = true
	return true
}

// Leave is the graceful start of a shutdown: it marks the region leaving
// in its registration (at once, and in every renewal after), so that the
// coordinator gives it no new shard and hands all of its shards off, then
// waits until the region holds no shard. It returns ctx's error when ctx
// ends first: the shards still held are then re-homed by the coordinator
// as after a crash once the region closes. Call Close afterwards.
func (a *Agent) Leave(ctx context.Context) error {
	if !a.markLeaving() {
		return ErrClosed
	}
	// Written at once even when ctx is done already (the store bounds the
	// write by its own timeout).
	if err := a.renew(context.WithoutCancel(ctx)); err != nil {
		a.log.Warn("cannot write the leaving registration now; the next renewal will", "err", err)
	}
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for {
		if len(a.Held()) == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// Close stops serving: it unsubscribes every shard, stops their entities
// (running their stop hooks), deregisters and returns. The connection is
// left to the caller. Messages published to the region's shards until the
// coordinator re-homes them are not delivered; call Leave first to hand
// the shards off without loss.
func (a *Agent) Close(ctx context.Context) error {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return ErrClosed
	}
	a.closed = true
	held := a.unbindLocked(a.heldLocked(), "region closing")
	a.mu.Unlock()
	_ = a.cmdSub.Unsubscribe()
	_ = a.querySub.Unsubscribe()
	a.cancel()
	err := a.host.stopAll(ctx)
	a.wg.Wait()
	// The lease loop has ended: no renewal races the release.
	a.renewMu.Lock()
	a.mu.Lock()
	lease, registered := a.lease, a.registered
	a.registered = false
	a.mu.Unlock()
	a.renewMu.Unlock()
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
