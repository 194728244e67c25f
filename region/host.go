package region

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"iter"
	"log/slog"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/passivation"
	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// Errors answered by the host to requests it cannot give to an entity.
var (
	// errShardNotServed answers a message delivered to a shard that is
	// being stopped (stopShard or stopAll began).
	errShardNotServed = refused(protocol.RefusedStopping, errors.New("shard not served here"))
	// errEntityPanicked answers a message whose Factory or Handle call
	// panicked. The panic value and stack are logged, never sent.
	errEntityPanicked = errors.New("entity panicked")
)

// defaultStopTimeout bounds each Stop call when hostConfig.StopTimeout is 0.
const defaultStopTimeout = 10 * time.Second

// maxConcurrentStops bounds the Stop hooks that run at the same time in one
// host (passivation and shard stops together).
const maxConcurrentStops = 64

// hostConfig configures a host.
type hostConfig struct {
	// Factory creates entities. Required.
	Factory Factory
	// Context is the parent of every shard's entity context (see host);
	// nil means context.Background().
	Context context.Context
	// IdleTimeout: passivateIdle stops entities idle this long; 0 means never.
	IdleTimeout time.Duration
	// MaxActive: passivateOverLimit stops the idle entities its policy
	// (Passivation) values least beyond this many; 0 means no limit.
	MaxActive int
	// Passivation names the policy of MaxActive (passivation.Names; ""
	// is passivation.Default, W-TinyLFU). An unknown name is logged and
	// the default used (Open refuses it first).
	Passivation string
	// StopTimeout bounds each Stop call; 0 means defaultStopTimeout.
	StopTimeout time.Duration
	// Logger; nil means slog.Default().
	Logger *slog.Logger
	// Now is the clock used for idleness; nil means time.Now.
	Now func() time.Time
	// Stalls, when set, is the number of stalls the region has handled
	// (stall.go); with check, it first looks for a stall and handles it.
	// A message of core delivery queued before a stall is not handled
	// after it: its shard may be another region's by then. Called
	// without the host's locks.
	Stalls func(check bool) uint64
	// Reply sends the answer to a request: data is the body and a non-nil
	// err goes in the error header. It is called only for messages with a
	// reply subject, from the goroutine that handled the message (or from
	// deliver for a refused message), and must not block for long. Set by
	// the driver; nil drops answers.
	Reply func(m *nats.Msg, data []byte, err error)
	// Trace is Config.Trace: called, when set, for each message with
	// headers before the entity's factory and Handle.
	Trace func(ctx context.Context, m *nats.Msg) (context.Context, func(err error))
	// Remember, when set, records an entity before a message activates
	// it (its error fails the activation); Forget is told an entity that
	// passivated itself (remember.go).
	Remember func(ctx context.Context, shard int, id string) error
	Forget   func(shard int, id string)
}

// host holds the entities of one region and runs their messages.
//
// # Execution
//
// Each entity lives in a cell: a FIFO mailbox (a pooled mailq, nil while
// the cell is idle), a running flag, the Entity (nil until the Factory
// made it) and the time of its last activity. deliver appends the message
// to a running cell's mailbox; an idle cell is marked running and put,
// with the message, on the host's ready queue (schedule). Workers take
// cells from the queue (worker, run): a worker creates the entity if
// needed, takes the cell's whole mailbox as a batch under one lock,
// handles it one message at a time in deliver order, and goes on until
// the mailbox is empty (the cell is idle again) or it has handled
// turnBudget messages (the cell goes back to the end of the queue). A
// worker that finds the queue empty parks (at most maxIdleWorkers; a
// worker parked for idleKeep to twice that exits: reap).
//
// A Handle may block (I/O), so the workers are not a fixed pool: a worker
// counts as searching except while it runs a cell or is parked, and
// whenever a cell is queued with no worker searching, a parked worker is
// woken or a new one started (the Go scheduler's rule for spinning
// threads). So a queued cell never waits for a blocked one, and the
// number of workers follows the number of cells running at once; under
// load a few workers run many cells' batches, where a goroutine per
// activation used to be started.
//
// So an entity handles one message at a time, different entities run
// concurrently, and an idle entity costs its cell and map entry, never a
// goroutine. Mailboxes are unbounded: back-pressure is the driver's
// business. Each worker reuses one Message for Handle (valid during
// Handle only, as Message says).
//
// # Activation and passivation
//
// The Factory is called by the cell's worker on the first message of an
// incarnation. When it fails (or panics) that message is answered with the
// error and the next message calls the Factory again; a cell left without
// entity and without messages is removed at once.
//
// passivateIdle stops entities that have been idle for IdleTimeout. The stop
// is run as part of the entity's serial execution: the cell is marked
// running, the Stop hook is called with no lock held, then messages that
// arrived meanwhile are kept and handled by a new incarnation (Factory
// again); with none the cell is removed. A message that arrives before the
// Stop hook has begun cancels the passivation instead.
//
// # Panics
//
// A panic in Factory, Handle or Stop is recovered and logged at error level
// with its stack; it never kills the process. A request whose Factory or
// Handle panicked is answered with errEntityPanicked. After a panic in
// Handle the incarnation is dropped WITHOUT calling its Stop hook (its state
// can no longer be trusted, and Stop is where entities persist): the next
// message creates a fresh incarnation with the Factory, which reloads
// persisted state. A panicking Stop counts as stopped.
//
// # Contexts
//
// Each shard has a context, the parent's (hostConfig.Context) child: the
// Factory and Handle of its entities get it. It ends when the shard's
// entities have all stopped, or at once when abortShard is called (the
// driver calls it when the shard is dropped or the region fenced or
// closed: the shard may already be another region's). A handoff leaves it
// alone until the entities have stopped, so that they finish the messages
// they were given.
//
// # Stopping shards
//
// stopShard refuses new deliveries to the shard (errShardNotServed), lets
// every entity finish the messages already in its mailbox, runs the Stop
// hooks (at most maxConcurrentStops at a time in the host, each bounded by
// StopTimeout) and removes the entities. When it is done the shard is
// forgotten: a later deliver to it (the shard was bound again) starts
// afresh. A Stop hook that outlives StopTimeout is abandoned (left running
// in its goroutine) and its entity counts as stopped: a new incarnation may
// then be created while the old hook still runs.
type host struct {
	factory     Factory
	idleTimeout time.Duration
	maxActive   int
	stopTimeout time.Duration
	log         *slog.Logger
	clock       func() time.Time
	replyFn     func(m *nats.Msg, data []byte, err error)
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

	// Counters of rare events (status.go).
	activations     atomic.Uint64 // entities created by the Factory
	passivations    atomic.Uint64 // idle entities stopped (for idleness or the limit)
	overLimit       atomic.Uint64 // of those, stopped because the region held more than MaxActive
	refusedStopping atomic.Uint64 // messages refused because their shard was being stopped

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
	peak    int           // largest len(cells) since the map was last rebuilt
	closing bool          // stopShard began: deliveries are refused
	drained chan struct{} // closed when closing and cells is empty
	// counts: the messages queued for the shard's entities and those
	// they finished (see status.go and load.go), under the lock that
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
	// evicting: the cells evict is waiting for (nil: none).
	evicting *eviction
}

// eviction counts the cells an evict waits for; done is closed when the
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
	remembered bool // hostConfig.Remember recorded the entity
	evict      bool // the entity stops once its mailbox is empty, and its cell goes (evict)
	// lim is the entity's entry in the limit's policy; nil without
	// MaxActive. (The cell is 48 bytes with it.)
	lim *limitEntry
}

// newHost returns a host that holds no entity yet.
func newHost(cfg hostConfig) *host {
	if cfg.Factory == nil {
		panic("region: hostConfig.Factory is nil")
	}
	h := &host{
		factory:     cfg.Factory,
		idleTimeout: cfg.IdleTimeout,
		maxActive:   cfg.MaxActive,
		stopTimeout: cfg.StopTimeout,
		log:         cfg.Logger,
		clock:       cfg.Now,
		replyFn:     cfg.Reply,
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
func (h *host) now() int64 {
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
	stalls uint64     // hostConfig.Stalls when it was delivered
	timer  *timerFire // set for a message of the entity's timer (timers.go)
}

// durableMsg is what a message of durable delivery carries besides itself:
// its stream sequence (the entity's context has it: SeqFrom), and what to
// do once its entity handled it (acknowledge it).
type durableMsg struct {
	seq  uint64
	done func()
}

// deliver queues m for entity id of shard and makes sure a worker runs
// the entity. It never waits for an entity. A shard being stopped refuses
// the message: a request is answered with errShardNotServed.
func (h *host) deliver(shard int, id string, m *nats.Msg) {
	e := envelope{m: m}
	if h.stalls != nil {
		e.stalls = h.stalls(false)
	}
	h.enqueue(shard, id, e)
}

// deliverDurable is deliver for a message of durable delivery: once its
// entity handled it (or failed to), d.done is called. A shard being
// stopped leaves it alone (neither answered nor done): it stays in the
// stream for the shard's next owner.
func (h *host) deliverDurable(shard int, id string, m *nats.Msg, d *durableMsg) {
	h.enqueue(shard, id, envelope{m: m, d: d})
}

func (h *host) enqueue(shard int, id string, e envelope) {
	se := h.shardFor(shard)
	se.mu.Lock()
	if se.closing {
		se.mu.Unlock()
		if e.d == nil {
			h.refuse(shard, id, e.m)
		}
		return
	}
	se.counts.delivered++
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
	if h.limit != nil {
		// An entity chosen to be passivated has its entry detached: a
		// message that cancels the passivation (queued), or goes to the
		// next incarnation (running), adds it again at once.
		h.touchLimit(se, c, key, c.stop != stopNone)
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
	h.schedule(task{se: se, c: c, id: key, first: e})
}

// start activates entity id of shard without a message (a remembered
// entity), unless the shard is being stopped or the entity has a cell
// already (it is active, or messages are on their way to it). It reports
// whether it started one.
func (h *host) start(shard int, id string) bool {
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

// restartsDone: the restart of shard's remembered entities ended; the
// entities that passivate themselves from now on need not be kept.
func (h *host) restartsDone(shard int) {
	se := h.lookup(shard)
	if se != nil {
		se.mu.Lock()
		se.restarted, se.forgotten = true, nil
		se.mu.Unlock()
	}
}

// passivate asks entity id of shard to stop once the message it handles
// is done; the messages queued after it go to a new incarnation.
func (h *host) passivate(shard int, id string) {
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
func (h *host) lookup(shard int) *shardEntities { return h.table.get(shard) }

// shardFor returns the shard's entities, creating them if needed.
func (h *host) shardFor(shard int) *shardEntities {
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

// shardTable maps shard numbers to their entities for lookups without a
// lock: pages of shardPage slots, each page made when a shard of its
// range first comes. A change writes one slot (under host.mu), where the
// copy of a map that this table replaced cost O(shards held) per change
// (BenchmarkTakeShards; its figures on both in docs/BENCHMARKS.md). A shard
// out of range (protocol.MaxShards; region.Open refuses more) is never
// held.
type shardTable struct {
	pages [protocol.MaxShards / shardPage]atomic.Pointer[[shardPage]atomic.Pointer[shardEntities]]
}

// shardPage is the number of slots in a page: 2 KiB of pointers.
const shardPage = 256

// get returns shard's entities, nil if none or if shard is out of range.
func (t *shardTable) get(shard int) *shardEntities {
	if uint(shard) >= protocol.MaxShards {
		return nil
	}
	if p := t.pages[shard/shardPage].Load(); p != nil {
		return p[shard%shardPage].Load()
	}
	return nil
}

// set makes se shard's entities (nil: none); the caller holds host.mu.
func (t *shardTable) set(shard int, se *shardEntities) {
	if uint(shard) >= protocol.MaxShards {
		return
	}
	p := t.pages[shard/shardPage].Load()
	if p == nil {
		p = new([shardPage]atomic.Pointer[shardEntities])
		t.pages[shard/shardPage].Store(p)
	}
	p[shard%shardPage].Store(se)
}

// each yields the shards held, in shard order, without a lock: a shard
// that comes or goes meanwhile may or may not be seen. The periodic walks
// (passivation, stop, status) take it; each locks the shards it looks
// into, and the message path uses get.
func (t *shardTable) each() iter.Seq[*shardEntities] {
	return func(yield func(*shardEntities) bool) {
		for i := range t.pages {
			p := t.pages[i].Load()
			if p == nil {
				continue
			}
			for j := range p {
				if se := p[j].Load(); se != nil && !yield(se) {
					return
				}
			}
		}
	}
}

// abortShard ends the context of shard's entities at once (see host). The
// shard's stop is the caller's business.
func (h *host) abortShard(shard int) {
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
func (h *host) removeLocked(se *shardEntities, id string, c *cell) {
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
// closed, so that a deliver after stopShard returned starts the shard
// afresh. (Taking h.mu under se.mu follows the lock order.)
func (h *host) drainedLocked(se *shardEntities) {
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

// turnBudget is how many messages a worker handles for one cell before
// it puts the cell back at the end of the ready queue, so that a busy
// entity does not keep a worker while other cells wait (Akka's
// dispatcher throughput).
const turnBudget = 64

// task is a cell made ready: its worker runs it until its mailbox is
// empty or its budget spent. first (when it has a message) is the message
// that made an idle cell ready, handled before the mailbox; the cell's
// mailbox then holds only the messages that came after it.
type task struct {
	se    *shardEntities
	c     *cell
	id    string // the cell's key in se.cells
	first envelope
}

// taskQueue is a FIFO of tasks in a ring buffer; host.qmu guards it.
type taskQueue struct {
	buf     []task
	head, n int
}

func (q *taskQueue) push(t task) {
	if q.n == len(q.buf) {
		buf := make([]task, max(64, 2*len(q.buf)))
		for i := range q.n {
			buf[i] = q.buf[(q.head+i)%len(q.buf)]
		}
		q.buf, q.head = buf, 0
	}
	q.buf[(q.head+q.n)%len(q.buf)] = t
	q.n++
}

func (q *taskQueue) pop() (task, bool) {
	if q.n == 0 {
		return task{}, false
	}
	t := q.buf[q.head]
	q.buf[q.head] = task{}
	q.head = (q.head + 1) % len(q.buf)
	q.n--
	if q.n == 0 && len(q.buf) > 1024 {
		q.buf, q.head = nil, 0 // a burst's queue is not kept
	}
	return t, true
}

// schedule queues a cell the caller marked running and makes sure a
// worker will take it: if every worker is running a cell (which may
// block: Handle, Stop and the Factory may do I/O), a parked one is woken
// or a new one started.
func (h *host) schedule(t task) {
	h.qmu.Lock()
	h.ready.push(t)
	if h.searching > 0 {
		h.qmu.Unlock()
		return
	}
	h.searching++
	w := h.unparkLocked()
	h.qmu.Unlock()
	h.wake(w)
}

// unparkLocked takes the worker parked last, nil if none (h.qmu held).
func (h *host) unparkLocked() *workerState {
	n := len(h.idle)
	if n == 0 {
		return nil
	}
	w := h.idle[n-1]
	h.idle[n-1] = nil
	h.idle = h.idle[:n-1]
	return w
}

// wake hands the search for ready cells to parked worker w, or to a new
// worker when w is nil.
func (h *host) wake(w *workerState) {
	if w == nil {
		go h.worker()
		return
	}
	w.wake <- true
}

// maxIdleWorkers bounds the workers parked in a host, each for idleKeep
// to twice that (reap): a worker parked when the queue emptied takes the
// next ready cell at the cost of a wake-up, with its stack grown already,
// where a new goroutine would start with a small one and grow it in
// Handle.
const (
	maxIdleWorkers = 64
	idleKeep       = 500 * time.Millisecond
)

// worker runs ready cells; when none is left it parks (at most
// maxIdleWorkers, until reap ends it) or exits. It counts as searching
// (host.searching) except while it runs a cell or is parked; a worker
// that takes a cell and leaves others queued with no other worker
// searching wakes or starts one. So while cells are queued some worker
// is about to take one, whatever the others are blocked in; and a burst
// of messages to idle entities is run by a few goroutines, not one per
// message.
func (h *host) worker() {
	w := &workerState{spare: newMailq(), wake: make(chan bool, 1)}
	h.qmu.Lock()
	for {
		t, ok := h.ready.pop()
		h.searching--
		if !ok {
			if !h.park(w) {
				return
			}
			continue // h.qmu held, searching again
		}
		var next *workerState
		more := h.ready.n > 0 && h.searching == 0
		if more {
			h.searching++
			next = h.unparkLocked()
		}
		h.qmu.Unlock()
		if more {
			h.wake(next)
		}
		again := h.run(t, w)
		h.qmu.Lock()
		h.searching++
		if again {
			t.first = envelope{}
			h.ready.push(t)
		}
	}
}

// park parks w (h.qmu held, released while parked) until a schedule
// wakes it: it returns true with h.qmu held and w counted as searching.
// It returns false, h.qmu released, when w should exit: too many parked
// already, or it stayed parked through a whole reap period (reap).
func (h *host) park(w *workerState) bool {
	if len(h.idle) >= maxIdleWorkers {
		h.qmu.Unlock()
		freeMailq(w.spare)
		return false
	}
	w.old = false
	h.idle = append(h.idle, w)
	if !h.reaping {
		h.reaping = true
		if h.reaper == nil {
			h.reaper = time.AfterFunc(idleKeep, h.reap)
		} else {
			h.reaper.Reset(idleKeep)
		}
	}
	h.qmu.Unlock()
	if !<-w.wake {
		freeMailq(w.spare)
		return false
	}
	h.qmu.Lock()
	return true
}

// reap, every idleKeep while workers are parked, ends those parked since
// the reap before: a worker parks for idleKeep to twice that. One timer
// for the host, rather than one per parking, keeps a parking to a channel
// receive.
func (h *host) reap() {
	h.qmu.Lock()
	defer h.qmu.Unlock()
	kept := h.idle[:0]
	for _, w := range h.idle {
		if w.old {
			w.wake <- false
			continue
		}
		w.old = true
		kept = append(kept, w)
	}
	clear(h.idle[len(kept):])
	h.idle = kept
	if len(h.idle) > 0 {
		h.reaper.Reset(idleKeep)
	} else {
		h.reaping = false
	}
}

// maxSpare bounds the mailbox array a worker keeps between cells.
const maxSpare = 256

// mailq is a cell's mailbox while it has messages queued: the cell
// holds a pointer (8 bytes, nil when idle) rather than the slice, so that
// an idle entity costs less. Mailboxes come from mailqs, with room for
// inline messages (more grow q), and go back to it when their cell goes
// idle or when a worker has taken their messages.
type mailq struct {
	q      []envelope
	inline [8]envelope
}

var mailqs = sync.Pool{New: func() any {
	m := new(mailq)
	m.q = m.inline[:0]
	return m
}}

// newMailq returns an empty mailbox.
func newMailq() *mailq { return mailqs.Get().(*mailq) }

// freeMailq gives an empty mailbox back to mailqs (nil: none).
func freeMailq(m *mailq) {
	if m == nil {
		return
	}
	m.trim()
	mailqs.Put(m)
}

// trim empties m, dropping an array a burst grew beyond maxSpare.
func (m *mailq) trim() {
	if cap(m.q) > maxSpare {
		m.q = m.inline[:0]
	}
	m.q = m.q[:0]
}

// box is c's mailbox, made if it has none (se.mu held).
func (c *cell) box() *mailq {
	if c.mailbox == nil {
		c.mailbox = newMailq()
	}
	return c.mailbox
}

// len is how many messages m holds (0 for nil).
func (m *mailq) len() int {
	if m == nil {
		return 0
	}
	return len(m.q)
}

// workerState is what a worker reuses from message to message: an empty
// mailbox array, and the Message given to Handle (valid during Handle
// only, as Message says).
type workerState struct {
	spare *mailq // empty
	msg   Message
	wake  chan bool // true: a schedule unparked it; false: reap ended it
	old   bool      // parked through a reap already (h.qmu)
}

// keep makes the empty mailbox mq w's spare, without an array grown
// beyond maxSpare.
func (w *workerState) keep(mq *mailq) {
	mq.trim()
	w.spare = mq
}

// run runs a cell for its worker. It takes the cell's whole mailbox at
// once (a batch: the cell gets *spare, empty, for what comes meanwhile),
// handles it one message at a time without the shard's lock, and takes
// the next batch, until the mailbox is empty: it returns false, the cell
// no longer running. When it has handled turnBudget messages and more are
// queued it returns true: the cell stays running and the caller queues
// it again. At the end of a shard stop it also stops the entity and
// removes the cell.
func (h *host) run(t task, w *workerState) (again bool) {
	se, c, id, shard := t.se, t.c, t.id, t.se.n
	var (
		counts msgCounts // handled since the last time se.mu was taken
		budget = turnBudget
		mq     = w.spare // the batch's mailbox, the cell's before
		batch  = mq.q[:0]
	)
	if t.first.m != nil {
		batch = append(batch, t.first)
	}
	// The running cell is this worker's: no other goroutine writes its
	// entity, so reading it needs no lock.
	ent := c.entity
	for {
		calls := h.passivateCalls.Load()
		for i := range batch {
			e := batch[i]
			batch[i] = envelope{}
			budget--
			if e.m == nil {
				ent = h.startOne(se, id, ent)
			} else {
				counts.handled++
				var err error
				if ent, err = h.deliverOne(se, id, c, ent, e, &w.msg); err != nil {
					counts.failed++
				}
			}
			if ent == nil {
				h.dropTimers(se, c) // the incarnation ended (a panic) or never began
			}
			if rest := batch[i+1:]; len(rest) > 0 && h.passivateCalls.Load() != calls {
				// Some entity asked to stop: if it is this one, the rest
				// of the batch goes back in front of the mailbox, for the
				// next incarnation.
				calls = h.passivateCalls.Load()
				se.mu.Lock()
				if c.passivate {
					mb := c.box()
					mb.q = append(slices.Clone(rest), mb.q...)
					clear(rest)
					se.mu.Unlock()
					break
				}
				se.mu.Unlock()
			}
		}
		w.msg = Message{} // what the batch's last Handle saw is not kept
		batch = batch[:0]
		mq.q = batch

		handled := counts.handled > 0
		var now int64
		if handled {
			now = h.now()
		}
		se.mu.Lock()
		c.entity = ent
		if handled {
			c.lastActive = now
			se.counts.add(counts)
			counts = msgCounts{}
		}
		if c.passivate && ent != nil && !se.closing {
			// The entity asked to stop: it stops now, and a new
			// incarnation handles the messages queued or to come.
			forget := c.remembered && h.forget != nil
			c.passivate, c.remembered = false, false
			if se.timers != nil {
				h.dropTimersLocked(se, c)
			}
			if forget && !se.restarted {
				if se.forgotten == nil {
					se.forgotten = make(map[string]struct{})
				}
				se.forgotten[id] = struct{}{}
			}
			c.stop = stopRunning // a timer started by the Stop hook is refused
			se.mu.Unlock()
			h.stopEntity(shard, id, ent)
			se.mu.Lock()
			c.stop = stopNone
			if h.limit != nil && c.mailbox.len() > 0 {
				// The next incarnation is counted at once: a check
				// during Stop may have detached the entry (as stopCell).
				h.touchLimit(se, c, id, true)
			}
			se.mu.Unlock()
			h.passivations.Add(1)
			if forget {
				h.forget(shard, id)
			}
			ent = nil
			continue
		}
		if c.mailbox.len() == 0 {
			if (se.closing || c.evict) && ent != nil {
				// Deliveries are refused now, so the mailbox stays empty.
				// An entity that asked to stop is forgotten; the others
				// stay remembered, for the shard's next owner.
				forget := c.passivate && c.remembered && h.forget != nil
				if se.timers != nil {
					h.dropTimersLocked(se, c)
				}
				se.mu.Unlock()
				h.stopEntity(shard, id, ent)
				if forget {
					h.forget(shard, id)
				}
				se.mu.Lock()
				ent, c.entity = nil, nil
			}
			c.running = false
			// The idle cell keeps no mailbox; the worker keeps one.
			freeMailq(c.mailbox)
			c.mailbox = nil
			if ent == nil {
				h.removeLocked(se, id, c)
			}
			se.mu.Unlock()
			w.keep(mq)
			return false
		}
		if budget <= 0 {
			se.mu.Unlock()
			w.keep(mq)
			return true
		}
		// Swap: the cell's mailbox is the next batch; the cell gets the
		// empty one, unless nothing comes for it meanwhile.
		mq, c.mailbox = c.mailbox, mq
		batch = mq.q
		se.mu.Unlock()
	}
}

// startOne creates the remembered entity id unless ent exists, and
// returns the entity (nil when the Factory failed: logged, and the
// entity's next message tries again).
func (h *host) startOne(se *shardEntities, id string, ent Entity) Entity {
	if ent != nil {
		return ent
	}
	ent, err := h.create(se.ctx, se.n, id)
	if err != nil {
		h.log.Warn("region: a remembered entity could not be started; its next message tries again", "shard", se.n, "entity", id, "error", err)
		return nil
	}
	return ent
}

// deliverOne gives the message e to entity id, creating the entity first
// when ent is nil, answers it, and returns the entity (nil when it has to
// be created again: it panicked, or could not be created).
//
// A message of durable delivery is done (acknowledged) once answered.
// When the entity (or its Factory) fails with ErrUnavailable (its state
// could not be read or written: JetStream has no leader for a moment), it
// is not answered: the entity gets it again after a pause, before any
// later message, until it succeeds or the shard leaves this region (then
// it stays in the stream for the next owner).
//
// It returns the error the message was answered with.
func (h *host) deliverOne(se *shardEntities, id string, c *cell, ent Entity, e envelope, msg *Message) (_ Entity, err error) {
	ctx, shard := se.ctx, se.n
	if e.timer != nil {
		// A timer's message: handled only if its timer is still due, and
		// dropped silently when the region stalled since it was queued.
		if !h.takeTimer(se, c, id, e.timer) || h.stalls != nil && h.stalls(true) != e.stalls {
			return ent, nil
		}
	} else if h.stalls != nil && e.d == nil && h.stalls(true) != e.stalls {
		// Queued before the region stalled: the shard may have been given
		// to another region meanwhile, which handles what came after it.
		// (Durable delivery's stream keeps the message for its owner.)
		h.refuse(shard, id, e.m)
		return ent, errShardNotServed
	}
	if h.trace != nil && e.m.Header != nil {
		var end func(error)
		if ctx, end = h.trace(ctx, e.m); end != nil {
			defer func() { end(err) }()
		}
	}
	var seq uint64
	if e.d != nil {
		ctx, seq = withSeq(ctx, e.d.seq), e.d.seq
	}
	var (
		key string // the message's idempotency key, or the key it asks the answer of
		ask bool   // it asks for the answer of key (protocol.HeaderAnswerOf)
	)
	if e.m.Header != nil {
		key, ask = answerKey(e.m.Header)
	}
	backoff := wait.RetryFirst
	for {
		var data []byte
		if ent == nil {
			if err = h.rememberOnce(ctx, se, id, c); err != nil {
				err = fmt.Errorf("remember entity: %w", err)
			} else if ent, err = h.create(ctx, shard, id); err != nil {
				err = fmt.Errorf("create entity: %w", err)
			}
		}
		if ent != nil {
			recalled := false
			if key != "" {
				// A key applied already is answered as the first
				// time, and not handled.
				ans, ok, panicked := h.recall(se, c, ent, key)
				switch {
				case panicked:
					data, err, recalled, ent = nil, errEntityPanicked, true, nil // as a panic in Handle
				case ok:
					data, err, recalled = ans.Data, ans.err(), true
				case ask:
					data, err, recalled = nil, refused(protocol.RefusedNoAnswer, errNoAnswer), true
				}
			}
			if !recalled {
				var ok bool
				if data, ok, err = h.handle(ctx, shard, id, ent, e.m, seq, e.timer, msg); !ok {
					ent = nil // panicked: drop this incarnation without Stop
				} else if key != "" && !transient(err) {
					h.keep(se, c, key, data, err)
				}
			}
		}
		if e.d != nil && errors.Is(err, ErrUnavailable) {
			if backoff == wait.RetryFirst {
				h.log.Warn("region: an entity could not handle a message of durable delivery; it gets it again", "shard", shard, "entity", id, "error", err)
			}
			if ctx.Err() != nil || !wait.Sleep(ctx, backoff) {
				return ent, err // the shard left: the message stays in the stream
			}
			backoff = wait.Next(backoff)
			continue
		}
		h.reply(shard, id, e.m, data, err)
		if e.d != nil {
			if err != nil && h.log.Enabled(ctx, slog.LevelDebug) {
				// Acknowledged all the same: the error is the answer.
				h.log.Debug("region: a message of durable delivery was answered with an error", "shard", shard, "entity", id, "seq", e.d.seq, "error", err)
			}
			e.d.done()
		}
		return ent, err
	}
}

// rememberOnce records entity id before its first activation, with
// hostConfig.Remember.
func (h *host) rememberOnce(ctx context.Context, se *shardEntities, id string, c *cell) error {
	if h.remember == nil {
		return nil
	}
	se.mu.Lock()
	known := c.remembered
	se.mu.Unlock()
	if known {
		return nil
	}
	if err := h.remember(ctx, se.n, id); err != nil {
		return err
	}
	se.mu.Lock()
	c.remembered = true
	se.mu.Unlock()
	return nil
}

// ErrUnavailable marks an error of an entity (or its Factory) that may
// pass if the message is tried again: what kvstate returns when JetStream
// does not answer. In durable delivery such a message is given to the
// entity again instead of being answered with the error.
var ErrUnavailable = kvstate.ErrUnavailable

type seqKey struct{}

func withSeq(ctx context.Context, seq uint64) context.Context {
	return context.WithValue(ctx, seqKey{}, seq)
}

// SeqFrom returns the stream sequence of the message being handled, from
// the context given to an entity's Handle (and to its Factory, for the
// message that activates it) in durable delivery; 0 in core delivery.
// Persistent entities save it with their state and skip a message they
// were given again (after a crash) at or below the one they applied.
func SeqFrom(ctx context.Context) uint64 {
	seq, _ := ctx.Value(seqKey{}).(uint64)
	return seq
}

// create calls the Factory; a panic is recovered (logged, and returned as
// errEntityPanicked).
func (h *host) create(ctx context.Context, shard int, id string) (ent Entity, err error) {
	defer func() {
		if r := recover(); r != nil {
			h.log.Error("region: entity factory panicked",
				"shard", shard, "entity", id, "panic", fmt.Sprint(r), "stack", string(debug.Stack()))
			ent, err = nil, errEntityPanicked
		}
	}()
	ent, err = h.factory(ctx, id)
	if err == nil && ent == nil {
		err = errors.New("entity factory returned no entity")
	}
	if err != nil {
		return nil, err
	}
	h.activations.Add(1)
	return ent, nil
}

// handle runs ent.Handle for m and returns its answer. ok is false when
// Handle panicked (err is errEntityPanicked then). msg is the worker's
// Message, filled for the call (run clears it after each batch: clearing
// it after each message took about 7 ns in a profile of shardctl bench).
func (h *host) handle(ctx context.Context, shard int, id string, ent Entity, m *nats.Msg, seq uint64, timer *timerFire, msg *Message) (data []byte, ok bool, err error) {
	defer func() {
		if r := recover(); r != nil {
			h.log.Error("region: entity panicked",
				"shard", shard, "entity", id, "subject", m.Subject, "panic", fmt.Sprint(r), "stack", string(debug.Stack()))
			data, ok, err = nil, false, errEntityPanicked
		}
	}()
	*msg = Message{
		EntityID: id,
		Shard:    shard,
		Subject:  m.Subject,
		Reply:    m.Reply,
		Header:   m.Header,
		Data:     m.Data,
		Seq:      seq,
	}
	if timer != nil {
		msg.timer = timer.name
	}
	data, err = ent.Handle(ctx, msg)
	return data, true, err
}

// reply answers a request; for a plain publish it only logs an error.
func (h *host) reply(shard int, id string, m *nats.Msg, data []byte, err error) {
	if m.Reply == "" {
		if err != nil {
			h.log.Debug("region: entity error on a publish",
				"shard", shard, "entity", id, "subject", m.Subject, "error", err)
		}
		return
	}
	if h.replyFn != nil {
		h.replyFn(m, data, err)
	}
}

// refuse answers a message delivered to a shard that is being stopped.
func (h *host) refuse(shard int, id string, m *nats.Msg) {
	h.refusedStopping.Add(1)
	if m.Reply == "" {
		h.log.Warn("region: message to a stopping shard dropped",
			"shard", shard, "entity", id, "subject", m.Subject)
		return
	}
	h.reply(shard, id, m, nil, errShardNotServed)
}

// stopEntity runs ent's Stop hook, bounded by the stop timeout and by the
// host's limit of concurrent stops. A hook that outlives its timeout is
// abandoned (it keeps running in its own goroutine) and the entity counts as
// stopped.
func (h *host) stopEntity(shard int, id string, ent Entity) {
	h.stopSem <- struct{}{}
	defer func() { <-h.stopSem }()
	ctx, cancel := context.WithTimeout(context.Background(), h.stopTimeout)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		defer func() {
			if r := recover(); r != nil {
				h.log.Error("region: entity stop hook panicked",
					"shard", shard, "entity", id, "panic", fmt.Sprint(r), "stack", string(debug.Stack()))
				done <- errEntityPanicked
			}
		}()
		done <- ent.Stop(ctx)
	}()
	select {
	case err := <-done:
		if err != nil && !errors.Is(err, errEntityPanicked) {
			h.log.Warn("region: entity stop hook failed", "shard", shard, "entity", id, "error", err)
		}
	case <-ctx.Done():
		h.log.Warn("region: entity stop hook exceeded the stop timeout; abandoned",
			"shard", shard, "entity", id, "timeout", h.stopTimeout.String())
	}
}

// stopItem is a cell queued for a stop (passivation or shard stop).
type stopItem struct {
	se    *shardEntities
	id    string
	c     *cell
	idle  bool // a passivation
	limit bool // a passivation for MaxActive
}

// runStops stops the queued cells with a bounded number of workers. It
// returns at once.
func (h *host) runStops(items []stopItem) {
	if len(items) == 0 {
		return
	}
	var next atomic.Int64
	workers := min(len(items), maxConcurrentStops)
	for range workers {
		go func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= len(items) {
					return
				}
				h.stopCell(items[i])
			}
		}()
	}
}

// stopCell completes a queued stop of a cell the caller marked running with
// stop == stopQueued.
func (h *host) stopCell(it stopItem) {
	se, c := it.se, it.c
	se.mu.Lock()
	if c.stop != stopQueued || c.mailbox.len() > 0 {
		// A delivery cancelled the passivation: run the messages.
		c.stop = stopNone
		se.mu.Unlock()
		h.schedule(task{se: se, c: c, id: it.id})
		return
	}
	c.stop = stopRunning
	ent := c.entity
	if se.timers != nil {
		h.dropTimersLocked(se, c)
	}
	se.mu.Unlock()

	if ent != nil {
		h.stopEntity(it.se.n, it.id, ent)
		if it.idle {
			h.passivations.Add(1)
		}
		if it.limit {
			h.overLimit.Add(1)
		}
	}

	se.mu.Lock()
	c.stop = stopNone
	c.entity = nil
	if c.mailbox.len() > 0 {
		// Messages arrived during Stop: a new incarnation handles them,
		// counted by the limit at once (a check during Stop may have
		// detached its entry again, after those messages' touches).
		if h.limit != nil {
			h.touchLimit(se, c, it.id, true)
		}
		se.mu.Unlock()
		h.schedule(task{se: se, c: c, id: it.id})
		return
	}
	c.running = false
	freeMailq(c.mailbox)
	c.mailbox = nil
	h.removeLocked(se, it.id, c)
	se.mu.Unlock()
}

// passivateIdle starts stopping every entity that has been idle for at
// least IdleTimeout (empty mailbox, not running) and returns how
// many it started. The Stop hooks run in the background; see host. It does
// nothing when IdleTimeout is 0. The driver calls it periodically.
func (h *host) passivateIdle() int {
	if h.idleTimeout <= 0 {
		return 0
	}
	deadline := h.now() - int64(h.idleTimeout)
	var items []stopItem
	for se := range h.table.each() {
		se.mu.Lock()
		if se.closing {
			se.mu.Unlock()
			continue
		}
		// Maps never shrink: rebuild one that lost most of its entries
		// (removed by earlier sweeps).
		if se.peak >= 1024 && len(se.cells)*4 < se.peak {
			se.cells = cloneCells(se.cells)
			se.peak = len(se.cells)
		}
		for id, c := range se.cells {
			if c.running || c.mailbox.len() > 0 || c.lastActive > deadline {
				continue
			}
			c.running = true
			c.stop = stopQueued
			items = append(items, stopItem{se: se, id: id, c: c, idle: true})
		}
		se.mu.Unlock()
	}
	h.runStops(items)
	return len(items)
}

// touchBatch is how many touches of the limit's policy a shard keeps
// before it gives them to the policy under one lock of it (as Caffeine's
// read buffers): the policy's mutex, shared by every shard, taken for
// each message, made BenchmarkDeliver 1.8 times slower with MaxActive.
const touchBatch = 32

// touchLimit records a message to cell c of entity id (se.mu held; id is
// c's key in se.cells) in the limit's policy. The cell's first message
// gives it its entry, added at once, as is a touch said to be now (its
// entry may be detached: an entry detached for a passivation that did not
// happen, because a message cancelled it, is added again as a newly
// activated entity). Other touches wait in se.touches, touchBatch at a
// time: passivateOverLimit gives them to the policy before it asks it for
// entities to passivate, so that it decides on every message so far; the
// cost is the order among shards' touches, by shard rather than by time,
// within one check (limitEvery). A cell being stopped (c.stop) may have
// its entry detached: the caller says now.
func (h *host) touchLimit(se *shardEntities, c *cell, id string, now bool) {
	if c.lim == nil {
		x := maphash.String(h.limitSeed, id)
		c.lim = &limitEntry{Hash: uint32(x ^ x>>32), Value: limitRef{id: id, shard: se.n}}
		now = true
	}
	if !now {
		se.touches = append(se.touches, c.lim)
		if len(se.touches) >= touchBatch {
			h.flushTouchesLocked(se)
		}
		return
	}
	h.limitMu.Lock()
	h.limit.Touch(c.lim)
	h.limitMu.Unlock()
}

// flushTouchesLocked gives se's waiting touches to the limit's policy
// (se.mu held). A touch of an entry detached meanwhile is dropped: its
// entity was removed, or chosen to be passivated (if a message cancels
// that, the message's touch adds the entry again).
func (h *host) flushTouchesLocked(se *shardEntities) {
	if len(se.touches) == 0 {
		return
	}
	h.limitMu.Lock()
	for _, e := range se.touches {
		if e.Attached() {
			h.limit.Touch(e)
		}
	}
	h.limitMu.Unlock()
	clear(se.touches)
	se.touches = se.touches[:0]
}

// passivateOverLimit starts stopping the idle entities (empty mailbox, not
// running) that the limit's policy values least, until the
// policy holds no more than MaxActive, and returns how many it started.
// The entities being stopped for the limit are detached from the policy,
// so they count as gone already. A busy entity is never chosen: the policy
// gets it back as just used, and the next choice is asked for; so the host
// holds more than MaxActive while more than MaxActive are busy. A message
// that arrives before the Stop hook has begun cancels the passivation (the
// entity was used again, and rejoins the policy as newly activated). It
// does nothing when MaxActive is 0. The driver calls it often: under the
// limit it costs a lock of each shard (to flush its touches) and one of
// the policy; over it, a lock of a shard per entity chosen.
func (h *host) passivateOverLimit() int {
	if h.limit == nil {
		return 0
	}
	for se := range h.table.each() {
		se.mu.Lock()
		h.flushTouchesLocked(se)
		se.mu.Unlock()
	}
	var (
		items   []stopItem
		victims []*limitEntry
		budget  = -1 // entries the policy may still offer in this call
	)
	for {
		h.limitMu.Lock()
		held := h.limit.Len()
		if budget < 0 {
			budget = held
		}
		need := min(held-h.maxActive, budget)
		if need <= 0 {
			h.limitMu.Unlock()
			break
		}
		victims = h.limit.Evict(need, victims[:0])
		h.limitMu.Unlock()
		if len(victims) == 0 {
			break
		}
		budget -= len(victims)
		for _, e := range victims {
			if it, ok := h.takeOverLimit(e); ok {
				items = append(items, it)
			}
		}
	}
	h.runStops(items)
	return len(items)
}

// takeOverLimit queues the stop of the entity of e, detached from the
// limit's policy, if it is idle. A busy entity goes back to the policy;
// one gone or on its way out is left alone (its cell is being removed, or
// its next message attaches it again).
func (h *host) takeOverLimit(e *limitEntry) (stopItem, bool) {
	ref := e.Value
	se := h.lookup(ref.shard)
	if se == nil {
		return stopItem{}, false
	}
	se.mu.Lock()
	defer se.mu.Unlock()
	c := se.cells[ref.id]
	switch {
	case c == nil || c.lim != e || se.closing || c.stop != stopNone:
		return stopItem{}, false
	case c.running || c.mailbox.len() > 0 || c.entity == nil:
		h.touchLimit(se, c, ref.id, true) // detached by Evict: added again
		return stopItem{}, false
	}
	c.running = true
	c.stop = stopQueued
	return stopItem{se: se, id: ref.id, c: c, idle: true, limit: true}, true
}

func cloneCells(m map[string]*cell) map[string]*cell {
	out := make(map[string]*cell, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// beginStop marks the shard closing and appends the stops of its idle cells
// to items; running cells stop themselves when their mailbox is empty. It
// returns the channel closed when the shard is drained (already closed when
// it holds nothing).
func (h *host) beginStop(se *shardEntities, items []stopItem) (<-chan struct{}, []stopItem) {
	se.mu.Lock()
	if !se.closing {
		se.closing = true
		se.drained = make(chan struct{})
		h.dropShardTimersLocked(se)
		for id, c := range se.cells {
			if c.running {
				continue // its worker, or a queued passivation, stops it
			}
			c.running = true
			c.stop = stopQueued
			items = append(items, stopItem{se: se, id: id, c: c})
		}
	}
	drained := se.drained
	h.drainedLocked(se)
	se.mu.Unlock()
	return drained, items
}

// evict stops the entities of shard whose id leaves says are no longer
// its own (a split gave them to a child: docs/PROTOCOL.md, Resharding) and
// removes their cells: an idle one at once, one with messages queued once
// it has handled them (nothing more is delivered to them: the region
// routes their messages to the child). Their Stop hook runs, and they stay
// remembered (their child starts them again). It returns a channel closed
// once all are removed. The shard's other entities are left alone. It is
// not called again on a shard before its channel closed.
func (h *host) evict(shard int, leaves func(id string) bool) <-chan struct{} {
	done := make(chan struct{})
	se := h.lookup(shard)
	if se == nil {
		close(done)
		return done
	}
	var items []stopItem
	ev := &eviction{done: done}
	se.mu.Lock()
	for id, c := range se.cells {
		if !leaves(id) {
			continue
		}
		c.evict = true
		ev.left++
		if !c.running {
			c.running = true
			c.stop = stopQueued
			items = append(items, stopItem{se: se, id: id, c: c})
		}
	}
	if ev.left == 0 {
		close(done)
	} else {
		se.evicting = ev
	}
	se.mu.Unlock()
	h.runStops(items)
	return done
}

// stopShard stops every entity of shard: from now on deliveries to it are
// refused, messages already queued are handled, then the Stop hooks run and
// the entities are removed. It returns when all are stopped, or with ctx's
// error when ctx ends first (the stops then go on in the background). The
// driver unsubscribes the shard before calling it.
func (h *host) stopShard(ctx context.Context, shard int) error {
	se := h.lookup(shard)
	if se == nil {
		return nil
	}
	drained, items := h.beginStop(se, nil)
	h.runStops(items)
	select {
	case <-drained:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("stop shard %d: %w", shard, ctx.Err())
	}
}

// stopAll stops every shard the host holds, as stopShard does, all at once.
func (h *host) stopAll(ctx context.Context) error {
	var (
		items  []stopItem
		shards []int
		waits  []<-chan struct{}
	)
	for se := range h.table.each() {
		var d <-chan struct{}
		d, items = h.beginStop(se, items)
		shards = append(shards, se.n)
		waits = append(waits, d)
	}
	h.runStops(items)
	var errs []error
	for i, d := range waits {
		select {
		case <-d:
		case <-ctx.Done():
			errs = append(errs, fmt.Errorf("stop shard %d: %w", shards[i], ctx.Err()))
		}
	}
	return errors.Join(errs...)
}

// active returns how many entities the host holds (created, being created
// or being stopped).
func (h *host) active() int {
	n := 0
	for se := range h.table.each() {
		se.mu.Lock()
		n += len(se.cells)
		se.mu.Unlock()
	}
	return n
}

// shardEntities returns the sorted ids of the entities held for shard.
func (h *host) shardEntities(shard int) []string {
	se := h.lookup(shard)
	if se == nil {
		return nil
	}
	se.mu.Lock()
	ids := make([]string, 0, len(se.cells))
	for id := range se.cells {
		ids = append(ids, id)
	}
	se.mu.Unlock()
	slices.Sort(ids)
	return ids
}
