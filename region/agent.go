package region

import (
	"cmp"
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
	"github.com/natshard/natshard/internal/passivation"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region/internal/host"
)

// Defaults of Config.
const (
	DefaultIdleTimeout  = 120 * time.Second
	DefaultLeaseTTL     = 4 * time.Second
	DefaultReleaseGrace = time.Second
	DefaultHandOffWait  = time.Second
)

// Errors of an Agent.
var (
	// ErrClosed is returned by an Agent that was closed.
	ErrClosed = errors.New("region: closed")
	// ErrRegionInUse: another live process serves the region id. Open
	// refuses to start; an Agent that finds another process registered
	// under its id after it was fenced stops for good (see Done).
	ErrRegionInUse = errors.New("region: the region id is in use by another live process")
)

// Config configures an Agent.
type Config struct {
	Conn   *nats.Conn
	Store  *kvstate.Store
	Buffer *kvstate.Buffer // the type's handoff buffer (required)
	// Stream is the type's message stream in durable delivery (one
	// stream, or several with shard s in stream s mod their number; a
	// split extends them first, checkSplit); nil for core delivery
	// (intake.go tells the difference).
	Stream   *kvstate.Stream
	Subjects protocol.Subjects
	Shards   int // shard count of the type, as stored in KV
	// Layout is the type's shard counts through its splits, as stored
	// (protocol.TypeConfig.Layout; the last one routes); zero: Shards,
	// never split. The region follows the splits the coordinator tells it
	// of (split.go).
	Layout  protocol.Layout
	ID      string // region id, unique per process
	Version string // application version (for rolling updates)
	Factory Factory
	// IdleTimeout passivates entities idle this long (default 120s;
	// negative: never).
	IdleTimeout time.Duration
	// MaxActive caps the entities active in the region: beyond it, the
	// idle entities PassivationPolicy values least are passivated (within
	// limitEvery). 0 means no limit. Ignored with Remember, as IdleTimeout.
	MaxActive int
	// PassivationPolicy chooses those entities: "w-tinylfu" (the default,
	// as "": Akka's default strategy, an LRU admission window before a
	// segmented LRU guarded by a frequency sketch) or "lru" (the least
	// recently used). See internal/passivation.
	PassivationPolicy string
	// LeaseTTL of the registration; renewed every LeaseTTL/4 or every
	// second, whichever is sooner (renewal.Interval), and soon again after a failure
	// (package renewal). The region stops serving when it could not
	// renew for 3/4 of it (self-fencing).
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
	// the buffer, or a live one while its region is suspended (default
	// kvstate.DefaultBufferPerShard); beyond it arrivals are dropped,
	// counted in Stats.HeldOverflow and unanswered (another region may
	// answer its copy: see shardState.stop).
	MaxHeld int
	Logger  *slog.Logger
	// Trace, when set, is called before the entity's factory and Handle
	// for each message that carries headers, on the entity's goroutine:
	// it returns the context they get (a trace context continued from a
	// traceparent header, say) and a function called with the outcome
	// once the message is handled (nil: none). Messages without headers
	// skip it, at the cost of a nil check.
	Trace func(ctx context.Context, m *nats.Msg) (context.Context, func(err error))
	// OnStep, when set, is told each handoff step of this region once it
	// ended (a pause, a replay); see Step. It runs on the region's own
	// goroutines and must not block.
	OnStep func(Step)
	// StallLimit: a region that finds it did not run for this long (its
	// process was stopped, a GC pause, a VM stall) suspends its shards
	// until it has confirmed them against the shard table, as after a lost
	// connection: the coordinator may have given them away meanwhile
	// (stall.go). Keep it below the coordinator's handoff timeout; 0 means
	// DefaultStallLimit, negative no stall watch (tests that play the
	// coordinator without a shard table): neither a stall nor a
	// registration deadline passed with a renewal unanswered suspends the
	// region then (see CoreConfig.ServeOnAtDeadline).
	StallLimit time.Duration
	// Remember, when set, keeps the ids of the active entities, and a
	// shard's new owner starts them again (remember.go). Entities are
	// then never passivated for idleness (IdleTimeout is ignored): they
	// stop when they Passivate, or when their shard leaves.
	Remember RememberStore
	// RestartRate: remembered entities started per second by the region
	// (0 means DefaultRestartRate).
	RestartRate int
}

// Agent hosts one type's region in this process: it registers, obeys the
// coordinator and dispatches messages to entities. Create it with Open and
// end it with Leave (optional: hands the shards off) and Close.
//
// Its decisions are made by a Core, owned by one driver goroutine (run,
// in driver.go) that takes the events of the command subscription, of the
// goroutines doing I/O (replays, releases, epoch checks, entity stops,
// registration writes) and of a ticker, steps the core and carries out
// what it returns. The driver never blocks on I/O: what waits runs in a
// goroutine of its own and reports back with an event.
type Agent struct {
	cfg Config
	log *slog.Logger
	// instance is unique per Agent, for every incarnation (see
	// protocol.RegionInfo.Instance).
	instance string
	// traceMsgs: the logger takes debug lines, so the replay logs each
	// message it delivers or skips (checked once: they are many).
	traceMsgs bool
	host      *host.Host

	// ctx lives until Close; the background work (replays, releases,
	// answers that wait) ends with it.
	ctx    context.Context
	cancel context.CancelFunc

	events   chan Event    // to the driver
	loopDone chan struct{} // closed when the driver returned
	replays  chan struct{} // a slot per replay reading its buffer (maxReplays)

	// onArrival, set by tests only (export_test.go), is called with each
	// message the shards' subscriptions receive, before it is routed.
	onArrival atomic.Pointer[func(m *nats.Msg)]

	// The driver's own, touched by no other goroutine (Open's before the
	// driver starts, Close's after it returned).
	core    *Core
	replyTo map[uint64]*nats.Msg // commands waiting for their answer
	local   []Event              // events the driver caused itself, taken first
	opened  chan error           // the first registration's outcome, for Open
	// shards is the data plane of the held shards, as the driver made
	// them (an intake per life: a goroutine working for a shard holds
	// its intake, and asks the intake's mode under the intake's lock).
	shards map[int]intake
	// stopping: shard -> closed when its entities have stopped (a closed
	// one is stale: the driver replaces it at the next stop).
	stopping map[int]chan struct{}

	closing atomic.Bool // Close was called

	// layout is the type's shard counts as the region routes by them:
	// changed by the driver when the region splits (split.go).
	layout atomic.Pointer[protocol.Layout]
	// subs are the region's subscriptions to data subjects, by shard
	// token (subjects.go); subsMu guards the map and the changes of their
	// routes.
	subsMu sync.Mutex
	subs   map[int]*subjectSub

	// view is the core's state after the driver's last step (serving.go),
	// written by the driver alone.
	view atomic.Pointer[view]

	clock stallClock // beats of the stall watch, registration deadline (stall.go)

	nextCmd  atomic.Uint64 // command ids
	cmdSub   *nats.Subscription
	querySub *nats.Subscription
	meter    loadMeter
	stats    Stats
	recorder *entityRecorder // with Config.Remember
	pace     pacer           // of the restarts of remembered entities
	limit    logLimiter
	wg       sync.WaitGroup

	done    chan struct{} // closed by fail
	failErr error         // why; set before done is closed
}

// Stats are counters of an Agent. Read them with Agent.Stats.
type Stats struct {
	Malformed atomic.Uint64 // malformed subjects or wrong shard
	NotOwned  atomic.Uint64 // messages of a shard that left without a handoff (held, or still in its subscription), dropped unanswered: its next holder answers its own copy
	Refused   atomic.Uint64 // commands refused (stale epoch, other incarnation, garbage, or closing, not registered, suspended)

	Buffered          atomic.Uint64 // messages of paused shards given to the buffer (BufferFailed of them were refused)
	BufferFailed      atomic.Uint64 // of those, the ones the buffer refused (full, or an error): lost; answered with an error while the source was the shard's one holder (appendFailed)
	Replayed          atomic.Uint64 // buffered messages replayed to entities
	Held              atomic.Uint64 // arrivals held while their shard's buffer was replayed or the region suspended
	DuplicatesSkipped atomic.Uint64 // copies skipped: a message with their key (protocol.MessageKey) was delivered since the bind
	HeldOverflow      atomic.Uint64 // arrivals beyond MaxHeld: refused while the shard pauses for a handoff, dropped unanswered while it replays or is suspended, or pauses on a suspended or stalled region (another may hold a copy)
	BufferFull        atomic.Uint64 // of BufferFailed, those refused because the shard's buffer was full
	SourceFenced      atomic.Uint64 // shards dropped as they paused: the coordinator had fenced their handoff (kvstate.Buffer.Fence)
	Stalls            atomic.Uint64 // times the region found it had not run for Config.StallLimit or more: suspended until confirmed (stall.go)
	DroppedAfterGap   atomic.Uint64 // arrivals of a paused shard dropped unanswered, not buffered, because its connection dropped since the pause (divertGap): the target holds its own copy

	Fenced         atomic.Uint64 // times the region fenced itself (stopped serving every shard)
	Suspended      atomic.Uint64 // times the connection dropped while registered: live shards held what arrived until confirmed
	Confirmed      atomic.Uint64 // suspensions that ended in a confirmation of the shards (the others ended in a fence)
	RenewalsFailed atomic.Uint64 // registration renewals that failed

	Restarted atomic.Uint64 // remembered entities started again without a message (Config.Remember)

	OldSubject atomic.Uint64 // messages taken from an ancestor's subject: published with a count the type had before a split (docs/PROTOCOL.md, Resharding)
}

// Open registers the region and starts serving commands. It returns when
// the region is registered, or with the error that prevented it.
func Open(ctx context.Context, cfg Config) (*Agent, error) {
	if cfg.Conn == nil || cfg.Store == nil || cfg.Buffer == nil || cfg.Factory == nil || cfg.Shards <= 0 {
		return nil, errors.New("region: Conn, Store, Buffer, Factory and Shards are required")
	}
	if cfg.Shards > protocol.MaxShards {
		return nil, fmt.Errorf("region: %d shards, at most %d", cfg.Shards, protocol.MaxShards)
	}
	if cfg.Layout.Shards() == 0 {
		cfg.Layout = protocol.MustLayout(cfg.Shards)
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
	if err := passivation.Check(cfg.PassivationPolicy); err != nil {
		return nil, fmt.Errorf("region: PassivationPolicy: %w", err)
	}
	a := &Agent{
		cfg:      cfg,
		log:      cfg.Logger.With("component", "region", "region", cfg.ID),
		instance: nuid.Next(),
		shards:   make(map[int]intake),
		subs:     make(map[int]*subjectSub),
		stopping: make(map[int]chan struct{}),
		events:   make(chan Event, 1024),
		loopDone: make(chan struct{}),
		replyTo:  make(map[uint64]*nats.Msg),
		done:     make(chan struct{}),
		replays:  make(chan struct{}, maxReplays),
	}
	a.layout.Store(&cfg.Layout)
	a.clock.base = time.Now()
	switch {
	case cfg.StallLimit == 0:
		a.clock.limit = int64(DefaultStallLimit)
	case cfg.StallLimit > 0:
		a.clock.limit = int64(cfg.StallLimit)
	}
	a.traceMsgs = a.log.Enabled(context.Background(), slog.LevelDebug)
	err := a.checkIDFree(ctx)
	if err != nil {
		return nil, err
	}
	a.ctx, a.cancel = context.WithCancel(context.Background())
	idle := cfg.IdleTimeout
	if idle < 0 || cfg.Remember != nil {
		idle = 0
	}
	maxActive := cfg.MaxActive
	if maxActive < 0 || cfg.Remember != nil {
		maxActive = 0
	}
	hc := host.Config{Factory: cfg.Factory, Context: a.ctx, IdleTimeout: idle, MaxActive: maxActive, Passivation: cfg.PassivationPolicy, Logger: a.log, Conn: cfg.Conn, Trace: cfg.Trace}
	if cfg.StallLimit >= 0 {
		hc.Stalls = a.stallCount
	}
	if cfg.Remember != nil {
		if cfg.RestartRate <= 0 {
			cfg.RestartRate = DefaultRestartRate
		}
		a.cfg.RestartRate = cfg.RestartRate
		a.pace.every = time.Second / time.Duration(cfg.RestartRate)
		a.recorder = newEntityRecorder(a, cfg.Remember)
		hc.Remember, hc.Forget = a.recorder.remember, a.recorder.forget
	}
	a.host = host.New(hc)
	a.core = NewCore(CoreConfig{
		Shards: cfg.Layout.Shards(), Region: cfg.ID, HandOffWait: max(1, int(cfg.HandOffWait/tickEvery)),
		LeaseTTL: cfg.LeaseTTL, Version: cfg.Version, Instance: a.instance, ServeOnAtDeadline: cfg.StallLimit < 0,
	}, "")
	a.opened = make(chan error, 1)
	a.carryOut(a.core.Start(time.Now()))
	go a.run()
	select {
	case err = <-a.opened:
	case <-ctx.Done():
		err = ctx.Err()
	}
	if err != nil {
		a.stop()
		return nil, err
	}
	sub, err := cfg.Conn.Subscribe(cfg.Subjects.Region(cfg.ID), a.onCommand)
	if err != nil {
		a.stop()
		return nil, fmt.Errorf("region: subscribe to commands: %w", err)
	}
	a.cmdSub = sub
	if a.querySub, err = cfg.Conn.Subscribe(cfg.Subjects.Query(cfg.ID), a.onQuery); err != nil {
		_ = sub.Unsubscribe()
		a.stop()
		return nil, fmt.Errorf("region: subscribe to queries: %w", err)
	}
	if err := cfg.Conn.Flush(); err != nil {
		_ = sub.Unsubscribe()
		_ = a.querySub.Unsubscribe()
		a.stop()
		return nil, fmt.Errorf("region: %w", err)
	}
	a.wg.Add(2)
	go a.passivationLoop(a.ctx)
	go a.stallWatch(a.ctx)
	if a.recorder != nil {
		a.wg.Add(1)
		go a.recorder.run(a.recorder.ctx)
	}
	a.log.Info("region registered", "incarnation", a.viewNow().incarnation)
	return a, nil
}

// stop ends an Agent that Open gives up on: the driver, then what it
// started.
func (a *Agent) stop() {
	a.post(stopLoop{})
	<-a.loopDone
	a.cancel()
	a.wg.Wait()
}

// ID is the region's id.
func (a *Agent) ID() string { return a.cfg.ID }

// Instance is unique per Agent: its registrations carry it
// (protocol.RegionInfo.Instance), whatever its incarnation.
func (a *Agent) Instance() string { return a.instance }

// Layout is the type's shard counts as the region routes by them now (the
// last is the type's count; it changes when the region splits).
func (a *Agent) Layout() protocol.Layout { return a.layoutNow() }

// layoutNow is the layout the region routes by now (the Config's, for an
// Agent made without Open: tests).
func (a *Agent) layoutNow() protocol.Layout {
	if l := a.layout.Load(); l != nil {
		return *l
	}
	return protocol.MustLayout(max(a.cfg.Shards, 1))
}

// Held returns the shards the region holds (serving, replaying or
// handing off), ascending.
func (a *Agent) Held() []int { return slices.Clone(a.viewNow().held) }

// Stats returns the agent's counters.
func (a *Agent) Stats() *Stats { return &a.stats }

// Active returns how many entities the region holds.
func (a *Agent) Active() int { return a.host.Active() }

// limitEvery: how often the region checks its entities against MaxActive.
const limitEvery = 100 * time.Millisecond

// passivationLoop passivates idle entities (every IdleTimeout/10, within
// 100 ms..10 s) and those beyond MaxActive (every limitEvery).
func (a *Agent) passivationLoop(ctx context.Context) {
	defer a.wg.Done()
	var idle, limit <-chan time.Time
	if a.host.IdleTimeout() > 0 {
		t := time.NewTicker(min(max(a.host.IdleTimeout()/10, 100*time.Millisecond), 10*time.Second))
		defer t.Stop()
		idle = t.C
	}
	if a.host.MaxActive() > 0 {
		t := time.NewTicker(limitEvery)
		defer t.Stop()
		limit = t.C
	}
	if idle == nil && limit == nil {
		return
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-idle:
			if n := a.host.PassivateIdle(); n > 0 {
				a.log.Debug("passivated idle entities", "count", n)
			}
		case <-limit:
			if n := a.host.PassivateOverLimit(); n > 0 {
				a.log.Debug("passivated entities beyond the limit", "count", n, "max_active", a.host.MaxActive(), "policy", cmp.Or(a.cfg.PassivationPolicy, passivation.Default))
			}
		}
	}
}

// Fence stops serving every shard at once and forgets the registration;
// the core registers a new incarnation, which starts with no shard. The
// region fences itself when its registration is lost or cannot be
// renewed in time, and the process calls Fence when its NATS connection
// is closed, so that a region cut off from NATS never serves a shard
// that the coordinator may have given to another. Shards being handed
// off are dropped too, without end marker: the coordinator re-homes them
// as after a crash. Fence returns once the driver has carried it out.
func (a *Agent) Fence(reason string) { a.postWait(Fenced{Reason: reason}) }

// Suspend is what the process calls when its NATS connection drops
// (nats.RECONNECTING). The region keeps its registration and its shards,
// but serves none of them: nats.go subscribes them again on reconnect,
// and what arrives is held (a durable shard stops pulling), because the
// coordinator may have given a shard to another region meanwhile. A
// shard in the middle of a move rides it through too: a replaying one
// stops delivering where it is (it holds its arrivals already), a paused
// one goes on diverting. Back on NATS (Reconnected), the region renews
// its registration, naming the new connection, by a compare-and-set: it
// fails if the coordinator removed the region (it removes one only by a
// compare-and-delete at the revision it saw before the region went
// silent), and then the region fences. Only after that renewal does the
// region read the shard table, and each shard goes on as its row says
// (Core.confirmed): live again (what it held first, in order), replaying
// on, diverting on, paused for a handoff the coordinator started
// meanwhile, or dropped. If the registration cannot be renewed before its
// deadline, the region fences (corereg.go). Suspend returns once the
// driver has suspended the shards: nats.go may resubscribe within
// milliseconds, and a delivery that found a stall looks again after it.
func (a *Agent) Suspend(reason string) { a.postWait(Suspended{Reason: reason}) }

// Reconnected is what the process calls when its NATS connection is back
// (nats.CONNECTED): a suspended region confirms its shards (see Suspend).
func (a *Agent) Reconnected() { a.post(Reconnected{}) }

// tableShards reads the shard table (every write made before the read)
// and returns the shards it gives to incarnation inc of this region:
// active there, or binding there (it may have gone live before the
// coordinator wrote it active).
func (a *Agent) tableShards(ctx context.Context, inc string) ([]int, error) {
	rows, err := a.cfg.Store.Shards(ctx)
	if err != nil {
		return nil, fmt.Errorf("read the shard table: %w", err)
	}
	var keep []int
	for _, r := range rows {
		if r.Region == a.cfg.ID && r.Incarnation == inc && (r.State == protocol.StateActive || r.State == protocol.StateBinding) {
			keep = append(keep, r.Shard)
		}
	}
	return keep, nil
}

// Leave is the graceful start of a shutdown: it marks the region leaving
// in its registration (at once, and in every renewal after), so that the
// coordinator gives it no new shard and hands all of its shards off, then
// waits until the region holds no shard. It returns ctx's error when ctx
// ends first: the shards still held are then re-homed by the coordinator
// as after a crash once the region closes. Call Close afterwards.
func (a *Agent) Leave(ctx context.Context) error {
	if a.closing.Load() {
		return ErrClosed
	}
	written, done := make(chan struct{}), make(chan struct{})
	a.post(Leaving{Written: written, Done: done})
	// The leaving registration is written even when ctx is done already
	// (the write is bounded by its renewal deadline).
	select {
	case <-written:
	case <-a.loopDone:
		return ErrClosed
	}
	select {
	case <-done:
		return nil
	default:
	}
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-a.loopDone:
		return ErrClosed
	}
}

// Close stops serving: it unsubscribes every shard, stops their entities
// (running their stop hooks), deregisters and returns. The connection is
// left to the caller. Messages published to the region's shards until the
// coordinator re-homes them are not delivered; call Leave first to hand
// the shards off without loss.
func (a *Agent) Close(ctx context.Context) error {
	if !a.closing.CompareAndSwap(false, true) {
		return ErrClosed
	}
	held := len(a.viewNow().held)
	// The driver unbinds every shard and fails what waits; once no
	// registration write is in flight, it stops.
	_ = a.cmdSub.Unsubscribe()
	_ = a.querySub.Unsubscribe()
	quiet := make(chan struct{})
	a.post(Closing{Done: quiet})
	select {
	case <-quiet:
	case <-ctx.Done():
	case <-a.loopDone:
	}
	a.post(stopLoop{})
	<-a.loopDone
	a.cancel()
	err := a.host.StopAll(ctx)
	if a.recorder != nil {
		a.recorder.stop() // after the entities' forgets
	}
	a.wg.Wait()
	// The driver has returned: the core is Close's, and no write races
	// the release.
	if a.core.Registered() {
		if rerr := a.cfg.Store.Release(ctx, a.core.Lease()); rerr != nil && !errors.Is(rerr, kvstate.ErrConflict) {
			err = errors.Join(err, fmt.Errorf("region: deregister: %w", rerr))
		}
	}
	a.publish(false)
	a.log.Info("region closed", "shards", held)
	return err
}

// Done is closed when the agent stopped for good by itself: another live
// process registered under its id (ErrRegionInUse; Err says more). It
// then serves nothing and never registers again; Close it. Done is not
// closed by Close.
func (a *Agent) Done() <-chan struct{} { return a.done }

// Err says why Done was closed; nil while it is open.
func (a *Agent) Err() error {
	select {
	case <-a.done:
		return a.failErr
	default:
		return nil
	}
}

// fail stops the agent for good: it is fenced already (it was about to
// register a new incarnation).
func (a *Agent) fail(err error) {
	a.log.Error("region stopped for good", "err", err)
	a.failErr = err
	close(a.done)
}

// idCheckWait bounds the question "does a process answer for this region
// id?" (checkIDFree, checkNotTakenOver).
const idCheckWait = time.Second

// checkIDFree refuses to start a region whose id another live process
// serves: when the id has a registration, its region is asked a query,
// and an answer means a process serves it (Open has not subscribed yet,
// so it is not this one). No responders means the registration is a dead
// process's (its subscriptions are gone from the server), which a
// restarted process takes over; no answer in time is taken over too (the
// holder is stuck, or its connection is dying), with a warning.
func (a *Agent) checkIDFree(ctx context.Context) error {
	info, _, err := a.cfg.Store.Region(ctx, a.cfg.ID)
	if errors.Is(err, kvstate.ErrNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("region: read the registration of %s: %w", a.cfg.ID, err)
	}
	qctx, cancel := context.WithTimeout(ctx, idCheckWait)
	defer cancel()
	m, err := a.cfg.Conn.RequestWithContext(qctx, a.cfg.Subjects.Query(a.cfg.ID), []byte(`{"shards":[0]}`))
	switch {
	case err == nil:
		var ans protocol.QueryAnswer
		_ = json.Unmarshal(m.Data, &ans)
		return fmt.Errorf("%w: region %s (incarnation %s, registered %s) answers from another process; stop it first, or give this one another region id",
			ErrRegionInUse, a.cfg.ID, cmp.Or(ans.Incarnation, info.Incarnation), time.UnixMilli(info.Started).Format(time.RFC3339))
	case errors.Is(err, nats.ErrNoResponders):
		return nil
	case ctx.Err() != nil:
		return ctx.Err()
	}
	a.log.Warn("the region id has a registration whose process does not answer; taking it over", "incarnation", info.Incarnation, "err", err)
	return nil
}

// checkNotTakenOver runs before a fenced agent registers again: when its
// id's registration was written by another process (another instance),
// it asks who answers on its query subject for a while; an answer from
// that other process means two processes share the id, and this one,
// which lost the registration, stops (ErrRegionInUse) instead of taking
// it back, which would fence the other, and so on for ever.
func (a *Agent) checkNotTakenOver(ctx context.Context) error {
	info, _, err := a.cfg.Store.Region(ctx, a.cfg.ID)
	if errors.Is(err, kvstate.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	if info.Instance == "" || info.Instance == a.instance {
		return nil
	}
	inbox := a.cfg.Conn.NewRespInbox()
	sub, err := a.cfg.Conn.SubscribeSync(inbox)
	if err != nil {
		return err
	}
	defer sub.Unsubscribe()
	if err := a.cfg.Conn.PublishRequest(a.cfg.Subjects.Query(a.cfg.ID), inbox, []byte(`{"shards":[0]}`)); err != nil {
		return err
	}
	deadline := time.Now().Add(idCheckWait)
	for {
		m, err := sub.NextMsg(time.Until(deadline))
		if err != nil {
			return nil // nobody else answered: a dead process's registration
		}
		var ans protocol.QueryAnswer
		if json.Unmarshal(m.Data, &ans) == nil && ans.Instance == info.Instance {
			return fmt.Errorf("%w: another process registered region %s (incarnation %s) and answers for it", ErrRegionInUse, a.cfg.ID, info.Incarnation)
		}
	}
}

// logLimiter logs each kind of repeated problem at most once per interval,
// with the number of occurrences since the last line. It takes no lock:
// each kind has an atomic count and the time of its last line, and the
// caller that moves that time on (compare-and-swap) writes the line.
type logLimiter struct {
	kinds sync.Map // kind -> *limitedKind
}

type limitedKind struct {
	n    atomic.Int64              // occurrences since the last line
	last atomic.Pointer[time.Time] // of the last line (monotonic); nil: none yet
}

const logEvery = 10 * time.Second

func (l *logLimiter) log(log *slog.Logger, kind, msg string, args ...any) {
	v, ok := l.kinds.Load(kind)
	if !ok {
		v, _ = l.kinds.LoadOrStore(kind, new(limitedKind))
	}
	k := v.(*limitedKind)
	k.n.Add(1)
	now := time.Now()
	last := k.last.Load()
	if last != nil && now.Sub(*last) < logEvery {
		return
	}
	if at := now; !k.last.CompareAndSwap(last, &at) {
		return // another caller writes the line
	}
	log.Warn(msg, append(args, "occurrences", k.n.Swap(0))...)
}
