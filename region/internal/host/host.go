package host

import (
	"context"
	"errors"
	"hash/maphash"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/passivation"
	"github.com/natshard/natshard/protocol"
)

// Errors answered by the host to requests it cannot give to an entity.
var (
	// errShardNotServed answers a message delivered to a shard that is
	// being stopped (StopShard or StopAll began).
	errShardNotServed = Refused(protocol.RefusedStopping, errors.New("shard not served here"))
	// errEntityPanicked answers a message whose Factory or Handle call
	// panicked. The panic value and stack are logged, never sent.
	errEntityPanicked = errors.New("entity panicked")
)

// defaultStopTimeout bounds each Stop call when Config.StopTimeout is 0.
const defaultStopTimeout = 10 * time.Second

// maxConcurrentStops bounds the Stop hooks that run at the same time in one
// host (passivation and shard stops together).
const maxConcurrentStops = 64

// Config configures a host.
type Config struct {
	// Factory creates entities. Required.
	Factory Factory
	// Context is the parent of every shard's entity context (package doc,
	// Contexts);
	// nil means context.Background().
	Context context.Context
	// IdleTimeout: PassivateIdle stops entities idle this long; 0 means never.
	IdleTimeout time.Duration
	// MaxActive: PassivateOverLimit stops the idle entities its policy
	// (Passivation) values least beyond this many; 0 means no limit.
	MaxActive int
	// Passivation names the policy of MaxActive (passivation.Names; ""
	// is passivation.Default, W-TinyLFU). An unknown name is logged and
	// the default used (region.Open refuses it first).
	Passivation string
	// StopTimeout bounds each Stop call; 0 means defaultStopTimeout.
	StopTimeout time.Duration
	// Logger; nil means slog.Default().
	Logger *slog.Logger
	// Now is the clock used for idleness; nil means time.Now.
	Now func() time.Time
	// Stalls, when set, is the number of stalls the region has handled
	// (region/stall.go); with check, it first looks for a stall and handles it.
	// A message of core delivery queued before a stall waits, when its
	// turn comes, for the region's verdict on its shard (Deliver). With check
	// it is called without the host's locks; without, maybe under a
	// shard's mutex (a timer's message), so it must only read a count.
	Stalls func(check bool) uint64
	// Conn sends the answers to requests (Answer), from the goroutine
	// that handled the message (or from Deliver for a refused one); nil
	// drops answers.
	Conn Publisher
	// Trace is region.Config.Trace: called, when set, for each message with
	// headers before the entity's factory and Handle.
	Trace func(ctx context.Context, m *nats.Msg) (context.Context, func(err error))
	// Remember, when set, records an entity before a message activates
	// it (its error fails the activation); Forget is told an entity that
	// passivated itself (region/remember.go).
	Remember func(ctx context.Context, shard int, id string) error
	Forget   func(shard int, id string)
}

// Host holds the entities of one region and runs their messages (see
// the package doc). Its methods are safe for concurrent use.
type Host struct {
	factory     Factory
	idleTimeout time.Duration
	maxActive   int
	stopTimeout time.Duration
	log         *slog.Logger
	clock       func() time.Time
	conn        Publisher
	trace       func(ctx context.Context, m *nats.Msg) (context.Context, func(err error))
	remember    func(ctx context.Context, shard int, id string) error
	forget      func(shard int, id string)
	stalls      func(check bool) uint64

	ctx     context.Context // parent of the shards' contexts
	epoch   time.Time       // lastActive values are offsets from it
	stopSem chan struct{}   // bounds concurrent Stop hooks

	// The scheduler (see Execution): the cells ready to run, in order,
	// and how many workers are searching: neither running a cell nor
	// parked (about to take one, or started and not yet running).
	qmu       sync.Mutex
	ready     taskQueue
	searching int
	idle      []*workerState // parked workers, the last parked last
	reaper    *time.Timer    // runs reap while workers are parked (reaping)
	reaping   bool

	// table holds the shards: written under mu, read without a lock by
	// lookup (an RWMutex's read lock, taken by every shard's
	// subscription for every message, was 14 % of the CPU of
	// BenchmarkDeliver and BenchmarkOnMessage: its reader count's cache
	// line going from core to core).
	mu    sync.RWMutex
	table shardTable
	gone  msgCounts // of the shards forgotten since; guarded by mu (see counts)

	// passivateCalls counts the cells marked passivate: a worker that
	// sees it change while it runs a batch checks its cell (run).
	passivateCalls atomic.Uint64

	// Counters of rare events (counts.go).
	activations     atomic.Uint64 // entities created by the Factory
	passivations    atomic.Uint64 // idle entities stopped (for idleness or the limit)
	overLimit       atomic.Uint64 // of those, stopped because the region held more than MaxActive
	refusedStopping atomic.Uint64 // messages no entity got because their shard was being stopped (refused, or dropped unanswered)
	tooLarge        rareLog       // answers too large to send
	droppedStopping rareLog       // messages of a stopping shard dropped unanswered (a shard's stop drops all it queued at once)

	// The active-entity limit's policy (nil without MaxActive): every
	// cell has an entry in it (cell.lim), attached but while it is being
	// passivated for the limit. limitMu guards the policy and the entries'
	// links; it is taken under a shard's mutex, never the reverse.
	limitMu   sync.Mutex
	limit     passivation.Policy[limitRef]
	limitSeed maphash.Seed // hashes ids for the policy's frequency sketch
}

// limitRef names a cell in the limit's policy.
type limitRef struct {
	id    string // the key of the cell in its shard's map
	shard int
}

// limitEntry is a cell's entry in the limit's policy: 48 bytes.
type limitEntry = passivation.Entry[limitRef]

// shardEntities holds the cells of one shard. Lock order: a goroutine may
// take host.mu while holding shardEntities.mu, never the reverse.
type shardEntities struct {
	n int // the shard
	// ctx is given to the shard's entities; cancel ends it (see host).
	ctx    context.Context
	cancel context.CancelFunc

	mu      sync.Mutex
	cells   map[string]*cell
	peak    int  // largest len(cells) since the map was last rebuilt
	closing bool // StopShard began: deliveries are refused
	// hold, heldAt, confirmed: the region's suspension of the shard
	// after a stall (HoldShard, ReleaseShard, confirmedAfter): hold is
	// closed when it ends, heldAt is the last stall it is held for,
	// confirmed the last stall the region confirmed the shard after.
	hold              chan struct{}
	heldAt, confirmed uint64
	drained           chan struct{} // closed when closing and cells is empty
	// counts: the messages queued for the shard's entities and those
	// they finished (counts.go), under the lock that
	// deliveries and each entity's worker take anyway.
	counts msgCounts
	// forgotten: the remembered entities that passivated themselves
	// before the restart of the shard's remembered entities ended
	// (restarted); start skips them, since the list it works from may
	// have been read before they were forgotten.
	forgotten map[string]struct{}
	restarted bool
	// touches: the limit's policy's touches of the shard's entities not
	// given to it yet (touchLimit).
	touches []*limitEntry
	// answers: the answers each active entity gave to keyed messages
	// (answers.go); nil until one came, an entry removed with its cell.
	answers map[*cell]*Answers
	// timers: the timers of the active entities that armed one
	// (timers.go); nil until one did, an entry removed with its cell.
	timers map[*cell]*entityTimers
	// evicting: the cells Evict is waiting for (nil: none).
	evicting *eviction
}

// eviction counts the cells an Evict waits for; done is closed when the
// last is removed.
type eviction struct {
	left int
	done chan struct{}
}

// Stop states of a cell.
const (
	stopNone    uint8 = iota
	stopQueued        // a passivation or shard stop is queued; a delivery cancels a passivation
	stopRunning       // the Stop hook is running; deliveries wait for the next incarnation
)

// cell is one entity's slot: kept small, it is what an idle entity costs.
// All fields are guarded by the shard's mutex.
type cell struct {
	mailbox    *mailq // nil when empty, always when idle
	entity     Entity // nil until created, and after a stop or a panic
	lastActive int64  // nanoseconds since host.epoch
	running    bool   // queued or run by a worker (or being stopped): the cell is its owner's
	stop       uint8
	passivate  bool // the entity asked to stop once its message is handled
	remembered bool // Config.Remember recorded the entity
	evict      bool // the entity stops once its mailbox is empty, and its cell goes (Evict)
	// lim is the entity's entry in the limit's policy; nil without
	// MaxActive. (The cell is 48 bytes with it.)
	lim *limitEntry
}

// New returns a host that holds no entity yet.
func New(cfg Config) *Host {
	if cfg.Factory == nil {
		panic("host: Config.Factory is nil")
	}
	h := &Host{
		factory:     cfg.Factory,
		idleTimeout: cfg.IdleTimeout,
		maxActive:   cfg.MaxActive,
		stopTimeout: cfg.StopTimeout,
		log:         cfg.Logger,
		clock:       cfg.Now,
		conn:        cfg.Conn,
		trace:       cfg.Trace,
		stalls:      cfg.Stalls,
		remember:    cfg.Remember,
		forget:      cfg.Forget,
		ctx:         cfg.Context,
		stopSem:     make(chan struct{}, maxConcurrentStops),
	}
	if h.ctx == nil {
		h.ctx = context.Background()
	}
	if h.stopTimeout <= 0 {
		h.stopTimeout = defaultStopTimeout
	}
	if h.log == nil {
		h.log = slog.Default()
	}
	if h.maxActive > 0 {
		p, err := passivation.New[limitRef](cfg.Passivation, h.maxActive)
		if err != nil {
			h.log.Error("region: unknown passivation policy; the default is used", "error", err, "default", passivation.Default)
			p, _ = passivation.New[limitRef](passivation.Default, h.maxActive)
		}
		h.limit, h.limitSeed = p, maphash.MakeSeed()
	}
	if h.clock == nil {
		h.epoch = time.Now()
	} else {
		h.epoch = h.clock()
	}
	return h
}

// now is the time since h.epoch. It runs after every message handled:
// without an injected clock it reads only the monotonic clock
// (time.Since), a third of the cost of time.Now().Sub (which also reads
// the wall clock); profiles of shardctl bench showed time.Now at 10% of
// the region's dispatch.
func (h *Host) now() int64 {
	if h.clock == nil {
		return int64(time.Since(h.epoch))
	}
	return int64(h.clock().Sub(h.epoch))
}

// envelope is a message in a mailbox; d is set for a message of durable
// delivery. An envelope without message starts a remembered entity
// (start).
type envelope struct {
	m      *nats.Msg
	d      *durableMsg
	stalls uint64     // Config.Stalls when it was delivered
	timer  *timerFire // set for a message of the entity's timer (timers.go)
	done   func()     // DeliverTracked's: called once the message is handled
}

// durableMsg is what a message of durable delivery carries besides itself:
// its stream sequence (the entity's context has it: SeqFrom), and what to
// do once its entity handled it (acknowledge it).
type durableMsg struct {
	seq  uint64
	done func()
}

// Deliver queues m for entity id of shard and makes sure a worker runs
// the entity. It never waits for an entity. A shard being stopped refuses
// the message: a request is answered with errShardNotServed.
//
// When the region stalls (Config.Stalls) before the message's turn, the
// shard may have been given to another region meanwhile: the message
// waits until the region has confirmed the shard against the shard table
// (HoldShard, ReleaseShard) and is handled then. It is dropped unanswered
// if the shard is aborted meanwhile (not the region's any more: a message
// a replay delivered is still in the buffer the next owner replays, and
// answered there), and refused if the shard was not held for that stall
// (paused for a handoff: the message, delivered live before the pause, is
// nowhere else).
func (h *Host) Deliver(shard int, id string, m *nats.Msg) {
	h.DeliverTracked(shard, id, m, nil)
}

// DeliverTracked is Deliver, and calls done (when not nil) once the
// entity has handled m and m was answered: Handle returned, with or
// without an error, or panicked, or the entity could not be created. A
// message that was not handled (refused or dropped unanswered, see
// Deliver) is never done. A replay tracks so which of the buffered
// messages it delivered have had their effect (region/replaytrail.go).
func (h *Host) DeliverTracked(shard int, id string, m *nats.Msg, done func()) {
	e := envelope{m: m, done: done}
	if h.stalls != nil {
		e.stalls = h.stalls(false)
	}
	h.enqueue(shard, id, e)
}

// HoldShard: the region suspended shard after its last stall (the count
// Config.Stalls gives now) until it has confirmed the shard against the
// shard table. A message Deliver queued before that stall waits,
// when its turn comes, for ReleaseShard (handled), StopShard (handled:
// the shard was the region's, which stops it) or AbortShard (dropped
// unanswered).
func (h *Host) HoldShard(shard int) {
	se := h.lookup(shard)
	if se == nil || h.stalls == nil {
		return // nothing queued (what comes later carries the new count), or no stall refuses anything
	}
	stall := h.stalls(false)
	se.mu.Lock()
	if !se.closing {
		if se.hold == nil {
			se.hold = make(chan struct{})
		}
		se.heldAt = max(se.heldAt, stall)
	}
	se.mu.Unlock()
}

// ReleaseShard: the region confirmed shard after the stalls it was held
// for (HoldShard); the messages waiting for that are handled.
func (h *Host) ReleaseShard(shard int) {
	if se := h.lookup(shard); se != nil {
		se.mu.Lock()
		se.releaseLocked()
		se.mu.Unlock()
	}
}

// releaseLocked ends se's hold: the stalls it was held for are confirmed.
func (se *shardEntities) releaseLocked() {
	se.confirmed = max(se.confirmed, se.heldAt)
	if se.hold != nil {
		close(se.hold)
		se.hold = nil
	}
}

// confirmedAfter waits, for a message Deliver queued before the
// region's stall number stall, while shard se is held (HoldShard) and
// reports whether the region confirmed it after that stall: false when
// the shard was aborted meanwhile, or not held for that stall (it was not
// suspended by it: paused for a handoff, or not the region's).
func (h *Host) confirmedAfter(se *shardEntities, stall uint64) bool {
	se.mu.Lock()
	defer se.mu.Unlock()
	for se.confirmed < stall {
		hold := se.hold
		if hold == nil || se.heldAt < stall || se.ctx.Err() != nil {
			return false
		}
		se.mu.Unlock()
		select {
		case <-hold:
		case <-se.ctx.Done():
		}
		se.mu.Lock()
	}
	return se.ctx.Err() == nil
}

// DeliverDurable is Deliver for a message of durable delivery, seq its
// stream sequence: once its entity handled it (or failed to), done is
// called. A shard being stopped leaves it alone (neither answered nor
// done): it stays in the stream for the shard's next owner.
func (h *Host) DeliverDurable(shard int, id string, m *nats.Msg, seq uint64, done func()) {
	h.enqueue(shard, id, envelope{m: m, d: &durableMsg{seq: seq, done: done}})
}

// IdleTimeout is Config.IdleTimeout: PassivateIdle stops the entities
// idle this long (0: never).
func (h *Host) IdleTimeout() time.Duration { return h.idleTimeout }

// MaxActive is Config.MaxActive: PassivateOverLimit stops idle entities
// beyond this many (0: no limit).
func (h *Host) MaxActive() int { return h.maxActive }

func (h *Host) enqueue(shard int, id string, e envelope) {
	se := h.shardFor(shard)
	se.mu.Lock()
	if se.closing {
		se.mu.Unlock()
		if e.d == nil {
			h.refuse(shard, id, e.m)
		}
		return
	}
	c, key := se.cells[id], id
	if c == nil {
		// Clone: id may point into a larger buffer (the subject).
		key = strings.Clone(id)
		c = &cell{lastActive: h.now()}
		se.cells[key] = c
		if len(se.cells) > se.peak {
			se.peak = len(se.cells)
		}
	}
	h.queueLocked(se, c, key, e)
}

// queueLocked queues e for cell c of entity id (se.mu held; it unlocks
// it): in the mailbox of a running cell; with an idle cell, made ready,
// to the scheduler. A message cancels a passivation whose Stop has not
// begun.
func (h *Host) queueLocked(se *shardEntities, c *cell, id string, e envelope) {
	se.counts.delivered++
	if h.limit != nil {
		// An entity chosen to be passivated has its entry detached: a
		// message that cancels the passivation (queued), or goes to the
		// next incarnation (running), adds it again at once.
		h.touchLimit(se, c, id, c.stop != stopNone)
	}
	if c.stop == stopQueued {
		c.stop = stopNone // cancel a passivation whose Stop has not begun
	}
	if c.running {
		mb := c.box()
		mb.q = append(mb.q, e)
		se.mu.Unlock()
		return
	}
	// An idle cell: its message goes with it to the scheduler, and its
	// mailbox stays empty (no allocation) unless more come meanwhile.
	c.running = true
	se.mu.Unlock()
	h.schedule(task{se: se, c: c, id: id, first: e})
}

// Start activates entity id of shard without a message (a remembered
// entity), unless the shard is being stopped or the entity has a cell
// already (it is active, or messages are on their way to it). It reports
// whether it started one.
func (h *Host) Start(shard int, id string) bool {
	se := h.shardFor(shard)
	se.mu.Lock()
	_, forgotten := se.forgotten[id]
	if se.closing || se.cells[id] != nil || forgotten {
		se.mu.Unlock()
		return false
	}
	c := &cell{lastActive: h.now(), running: true, remembered: true, mailbox: newMailq()}
	c.mailbox.q = append(c.mailbox.q, envelope{})
	se.cells[id] = c
	se.peak = max(se.peak, len(se.cells))
	if h.limit != nil {
		h.touchLimit(se, c, id, true)
	}
	se.mu.Unlock()
	h.schedule(task{se: se, c: c, id: id})
	return true
}

// RestartsDone: the restart of shard's remembered entities ended; the
// entities that passivate themselves from now on need not be kept.
func (h *Host) RestartsDone(shard int) {
	se := h.lookup(shard)
	if se != nil {
		se.mu.Lock()
		se.restarted, se.forgotten = true, nil
		se.mu.Unlock()
	}
}

// Passivate asks entity id of shard to stop once the message it handles
// is done; the messages queued after it go to a new incarnation.
func (h *Host) Passivate(shard int, id string) {
	se := h.lookup(shard)
	if se == nil {
		return
	}
	se.mu.Lock()
	if c := se.cells[id]; c != nil {
		c.passivate = true
		h.passivateCalls.Add(1)
	}
	se.mu.Unlock()
}

// lookup returns the shard's entities, nil if the host holds none.
func (h *Host) lookup(shard int) *shardEntities { return h.table.get(shard) }

// shardFor returns the shard's entities, creating them if needed.
func (h *Host) shardFor(shard int) *shardEntities {
	if se := h.lookup(shard); se != nil {
		return se
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	se := h.table.get(shard)
	if se == nil {
		se = &shardEntities{n: shard, cells: make(map[string]*cell)}
		se.ctx, se.cancel = context.WithCancel(h.ctx)
		h.table.set(shard, se)
	}
	return se
}

// AbortShard ends the context of shard's entities at once (see host). The
// shard's stop is the caller's business.
func (h *Host) AbortShard(shard int) {
	se := h.lookup(shard)
	if se != nil {
		se.cancel()
		se.mu.Lock()
		h.dropShardTimersLocked(se)
		se.mu.Unlock()
	}
}

// removeLocked deletes cell c of id from se (locked) and completes a shard
// stop that was waiting for it.
func (h *Host) removeLocked(se *shardEntities, id string, c *cell) {
	if se.cells[id] == c {
		delete(se.cells, id)
	}
	if c.evict {
		c.evict = false
		if ev := se.evicting; ev != nil {
			if ev.left--; ev.left == 0 {
				close(ev.done)
				se.evicting = nil
			}
		}
	}
	if se.answers != nil {
		delete(se.answers, c)
	}
	if se.timers != nil {
		h.dropTimersLocked(se, c)
	}
	if c.lim != nil {
		h.limitMu.Lock()
		h.limit.Remove(c.lim)
		h.limitMu.Unlock()
	}
	h.drainedLocked(se)
}

// drainedLocked completes the stop of se's shard when se (locked) is
// closing and holds no cell any more: the host forgets the shard, then se.drained is
// closed, so that a Deliver after StopShard returned starts the shard
// afresh. (Taking h.mu under se.mu follows the lock order.)
func (h *Host) drainedLocked(se *shardEntities) {
	if !se.closing || len(se.cells) > 0 {
		return
	}
	select {
	case <-se.drained:
		return
	default:
	}
	h.mu.Lock()
	if h.table.get(se.n) == se {
		h.table.set(se.n, nil)
		h.gone.add(se.counts)
	}
	h.mu.Unlock()
	se.cancel()
	close(se.drained)
}
