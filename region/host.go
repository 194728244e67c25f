package region

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
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
	// MaxActive: passivateOverLimit stops the least recently used idle
	// entities beyond this many; 0 means no limit.
	MaxActive int
	// StopTimeout bounds each Stop call; 0 means defaultStopTimeout.
	StopTimeout time.Duration
	// Logger; nil means slog.Default().
	Logger *slog.Logger
	// Now is the clock used for idleness; nil means time.Now.
	Now func() time.Time
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
// Each entity lives in a cell: a FIFO mailbox, a running flag, the Entity
// (nil until the Factory made it) and the time of its last activity. deliver
// appends the message to the cell's mailbox and, when no goroutine runs the
// cell, starts one; that goroutine creates the entity if needed, handles the
// mailbox one message at a time in deliver order and exits when the mailbox
// is empty. So an entity handles one message at a time, different entities
// run concurrently, and an idle entity costs its cell and map entry, never a
// goroutine. Mailboxes are unbounded: back-pressure is the driver's business.
//
// # Activation and passivation
//
// The Factory is called by the cell's goroutine on the first message of an
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

	ctx     context.Context // parent of the shards' contexts
	epoch   time.Time       // lastActive values are offsets from it
	stopSem chan struct{}   // bounds concurrent Stop hooks

	mu     sync.RWMutex
	shards map[int]*shardEntities
	gone   handledCounts // of the shards forgotten since; guarded by mu (see counts)

	// Counters of rare events (status.go).
	activations     atomic.Uint64 // entities created by the Factory
	passivations    atomic.Uint64 // idle entities stopped (for idleness or the limit)
	overLimit       atomic.Uint64 // of those, stopped because the region held more than MaxActive
	refusedStopping atomic.Uint64 // messages refused because their shard was being stopped
}

// shardEntities holds the cells of one shard. Lock order: a goroutine may
// take host.mu while holding shardEntities.mu, never the reverse.
type shardEntities struct {
	// ctx is given to the shard's entities; cancel ends it (see host).
	ctx    context.Context
	cancel context.CancelFunc

	mu      sync.Mutex
	cells   map[string]*cell
	peak    int           // largest len(cells) since the map was last rebuilt
	closing bool          // stopShard began: deliveries are refused
	drained chan struct{} // closed when closing and cells is empty
	// delivered counts the messages queued for the shard's entities (see
	// load.go).
	delivered uint64
	// handled counts the messages the shard's entities finished (see
	// status.go), under the lock each entity's goroutine takes anyway.
	handled handledCounts
	// forgotten: the remembered entities that passivated themselves
	// before the restart of the shard's remembered entities ended
	// (restarted); start skips them, since the list it works from may
	// have been read before they were forgotten.
	forgotten map[string]struct{}
	restarted bool
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
	mailbox    []envelope
	entity     Entity // nil until created, and after a stop or a panic
	lastActive int64  // nanoseconds since host.epoch
	running    bool   // a goroutine owns the cell
	stop       uint8
	passivate  bool // the entity asked to stop once its message is handled
	remembered bool // hostConfig.Remember recorded the entity
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
		remember:    cfg.Remember,
		forget:      cfg.Forget,
		ctx:         cfg.Context,
		stopSem:     make(chan struct{}, maxConcurrentStops),
		shards:      make(map[int]*shardEntities),
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
	m *nats.Msg
	d *durableMsg
}

// durableMsg is what a message of durable delivery carries besides itself:
// its stream sequence (the entity's context has it: SeqFrom), and what to
// do once its entity handled it (acknowledge it).
type durableMsg struct {
	seq  uint64
	done func()
}

// deliver queues m for entity id of shard and makes sure a goroutine runs
// the entity. It never waits for an entity. A shard being stopped refuses
// the message: a request is answered with errShardNotServed.
func (h *host) deliver(shard int, id string, m *nats.Msg) { h.enqueue(shard, id, envelope{m: m}) }

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
	se.delivered++
	c := se.cells[id]
	if c == nil {
		// Clone: id may point into a larger buffer (the subject).
		c = &cell{lastActive: h.now()}
		se.cells[strings.Clone(id)] = c
		if len(se.cells) > se.peak {
			se.peak = len(se.cells)
		}
	}
	c.mailbox = append(c.mailbox, e)
	if c.stop == stopQueued {
		c.stop = stopNone // cancel a passivation whose Stop has not begun
	}
	if c.running {
		se.mu.Unlock()
		return
	}
	c.running = true
	se.mu.Unlock()
	go h.run(se, shard, id, c)
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
	c := &cell{lastActive: h.now(), running: true, remembered: true, mailbox: []envelope{{}}}
	se.cells[id] = c
	se.peak = max(se.peak, len(se.cells))
	se.mu.Unlock()
	go h.run(se, shard, id, c)
	return true
}

// restartsDone: the restart of shard's remembered entities ended; the
// entities that passivate themselves from now on need not be kept.
func (h *host) restartsDone(shard int) {
	h.mu.RLock()
	se := h.shards[shard]
	h.mu.RUnlock()
	if se != nil {
		se.mu.Lock()
		se.restarted, se.forgotten = true, nil
		se.mu.Unlock()
	}
}

// passivate asks entity id of shard to stop once the message it handles
// is done; the messages queued after it go to a new incarnation.
func (h *host) passivate(shard int, id string) {
	h.mu.RLock()
	se := h.shards[shard]
	h.mu.RUnlock()
	if se == nil {
		return
	}
	se.mu.Lock()
	if c := se.cells[id]; c != nil {
		c.passivate = true
	}
	se.mu.Unlock()
}

// shardFor returns the shard's entities, creating them if needed.
func (h *host) shardFor(shard int) *shardEntities {
	h.mu.RLock()
	se := h.shards[shard]
	h.mu.RUnlock()
	if se != nil {
		return se
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if se = h.shards[shard]; se == nil {
		se = &shardEntities{cells: make(map[string]*cell)}
		se.ctx, se.cancel = context.WithCancel(h.ctx)
		h.shards[shard] = se
	}
	return se
}

// abortShard ends the context of shard's entities at once (see host). The
// shard's stop is the caller's business.
func (h *host) abortShard(shard int) {
	h.mu.RLock()
	se := h.shards[shard]
	h.mu.RUnlock()
	if se != nil {
		se.cancel()
	}
}

// snapshot returns the shards held, in no particular order.
func (h *host) snapshot() map[int]*shardEntities {
	h.mu.RLock()
	defer h.mu.RUnlock()
	out := make(map[int]*shardEntities, len(h.shards))
	for n, se := range h.shards {
		out[n] = se
	}
	return out
}

// removeLocked deletes cell c of id from se (locked) and completes a shard
// stop that was waiting for it.
func (h *host) removeLocked(se *shardEntities, shard int, id string, c *cell) {
	if se.cells[id] == c {
		delete(se.cells, id)
	}
	h.drainedLocked(se, shard)
}

// drainedLocked completes the stop of shard when se (locked) is closing and
// holds no cell any more: the host forgets the shard, then se.drained is
// closed, so that a deliver after stopShard returned starts the shard
// afresh. (Taking h.mu under se.mu follows the lock order.)
func (h *host) drainedLocked(se *shardEntities, shard int) {
	if !se.closing || len(se.cells) > 0 {
		return
	}
	select {
	case <-se.drained:
		return
	default:
	}
	h.mu.Lock()
	if h.shards[shard] == se {
		delete(h.shards, shard)
		h.gone.add(se.handled)
	}
	h.mu.Unlock()
	se.cancel()
	close(se.drained)
}

// run is the goroutine of a cell that has work: it handles the mailbox one
// message at a time and exits when it is empty. At the end of a shard stop
// it also stops the entity and removes the cell.
func (h *host) run(se *shardEntities, shard int, id string, c *cell) {
	var (
		ent     Entity
		loaded  bool
		handled bool
		counts  handledCounts // since the last time se.mu was taken
	)
	for {
		var now int64
		if handled {
			now = h.now()
		}
		se.mu.Lock()
		if loaded {
			c.entity = ent
		} else {
			ent, loaded = c.entity, true
		}
		if handled {
			c.lastActive = now
			se.handled.add(counts)
			counts = handledCounts{}
		}
		if c.passivate && ent != nil && !se.closing {
			// The entity asked to stop: it stops now, and a new
			// incarnation handles the messages queued or to come.
			forget := c.remembered && h.forget != nil
			c.passivate, c.remembered = false, false
			if forget && !se.restarted {
				if se.forgotten == nil {
					se.forgotten = make(map[string]struct{})
				}
				se.forgotten[id] = struct{}{}
			}
			se.mu.Unlock()
			h.stopEntity(shard, id, ent)
			h.passivations.Add(1)
			if forget {
				h.forget(shard, id)
			}
			ent, handled = nil, false
			continue
		}
		if len(c.mailbox) == 0 {
			if se.closing && ent != nil {
				// Deliveries are refused now, so the mailbox stays empty.
				// An entity that asked to stop is forgotten; the others
				// stay remembered, for the shard's next owner.
				forget := c.passivate && c.remembered && h.forget != nil
				se.mu.Unlock()
				h.stopEntity(shard, id, ent)
				if forget {
					h.forget(shard, id)
				}
				se.mu.Lock()
				ent, c.entity = nil, nil
			}
			c.running = false
			c.mailbox = nil // release the backing array
			if ent == nil {
				h.removeLocked(se, shard, id, c)
			}
			se.mu.Unlock()
			return
		}
		e := c.mailbox[0]
		c.mailbox[0] = envelope{}
		c.mailbox = c.mailbox[1:]
		se.mu.Unlock()

		if e.m == nil {
			ent = h.startOne(se, shard, id, c, ent)
			continue
		}
		handled = true
		counts.handled++
		var err error
		if ent, err = h.deliverOne(se, shard, id, c, ent, e); err != nil {
			counts.failed++
		}
	}
}

// startOne creates the remembered entity id unless ent exists, and
// returns the entity (nil when the Factory failed: logged, and the
// entity's next message tries again).
func (h *host) startOne(se *shardEntities, shard int, id string, c *cell, ent Entity) Entity {
	if ent != nil {
		return ent
	}
	ent, err := h.create(se.ctx, shard, id)
	if err != nil {
		h.log.Warn("region: a remembered entity could not be started; its next message tries again", "shard", shard, "entity", id, "error", err)
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
func (h *host) deliverOne(se *shardEntities, shard int, id string, c *cell, ent Entity, e envelope) (_ Entity, err error) {
	ctx := se.ctx
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
	backoff := retryFirst
	for {
		var data []byte
		if ent == nil {
			if err = h.rememberOnce(ctx, se, shard, id, c); err != nil {
				err = fmt.Errorf("remember entity: %w", err)
			} else if ent, err = h.create(ctx, shard, id); err != nil {
				err = fmt.Errorf("create entity: %w", err)
			}
		}
		if ent != nil {
			var ok bool
			if data, ok, err = h.handle(ctx, shard, id, ent, e.m, seq); !ok {
				ent = nil // panicked: drop this incarnation without Stop
			}
		}
		if e.d != nil && errors.Is(err, ErrUnavailable) {
			if backoff == retryFirst {
				h.log.Warn("region: an entity could not handle a message of durable delivery; it gets it again", "shard", shard, "entity", id, "error", err)
			}
			if ctx.Err() != nil || !wait.Sleep(ctx, backoff) {
				return ent, err // the shard left: the message stays in the stream
			}
			backoff = min(2*backoff, retryMax)
			continue
		}
		h.reply(shard, id, e.m, data, err)
		if e.d != nil {
			e.d.done()
		}
		return ent, err
	}
}

// rememberOnce records entity id before its first activation, with
// hostConfig.Remember.
func (h *host) rememberOnce(ctx context.Context, se *shardEntities, shard int, id string, c *cell) error {
	if h.remember == nil {
		return nil
	}
	se.mu.Lock()
	known := c.remembered
	se.mu.Unlock()
	if known {
		return nil
	}
	if err := h.remember(ctx, shard, id); err != nil {
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
// Handle panicked (err is errEntityPanicked then).
func (h *host) handle(ctx context.Context, shard int, id string, ent Entity, m *nats.Msg, seq uint64) (data []byte, ok bool, err error) {
	defer func() {
		if r := recover(); r != nil {
			h.log.Error("region: entity panicked",
				"shard", shard, "entity", id, "subject", m.Subject, "panic", fmt.Sprint(r), "stack", string(debug.Stack()))
			data, ok, err = nil, false, errEntityPanicked
		}
	}()
	data, err = ent.Handle(ctx, &Message{
		EntityID: id,
		Shard:    shard,
		Subject:  m.Subject,
		Reply:    m.Reply,
		Header:   m.Header,
		Data:     m.Data,
		Seq:      seq,
	})
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
	shard int
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
	if c.stop != stopQueued || len(c.mailbox) > 0 {
		// A delivery cancelled the passivation: run the messages.
		c.stop = stopNone
		se.mu.Unlock()
		go h.run(se, it.shard, it.id, c)
		return
	}
	c.stop = stopRunning
	ent := c.entity
	se.mu.Unlock()

	if ent != nil {
		h.stopEntity(it.shard, it.id, ent)
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
	if len(c.mailbox) > 0 {
		// Messages arrived during Stop: a new incarnation handles them.
		se.mu.Unlock()
		go h.run(se, it.shard, it.id, c)
		return
	}
	c.running = false
	c.mailbox = nil
	h.removeLocked(se, it.shard, it.id, c)
	se.mu.Unlock()
}

// passivateIdle starts stopping every entity that has been idle for at
// least IdleTimeout (empty mailbox, no goroutine running it) and returns how
// many it started. The Stop hooks run in the background; see host. It does
// nothing when IdleTimeout is 0. The driver calls it periodically.
func (h *host) passivateIdle() int {
	if h.idleTimeout <= 0 {
		return 0
	}
	deadline := h.now() - int64(h.idleTimeout)
	var items []stopItem
	for n, se := range h.snapshot() {
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
			if c.running || len(c.mailbox) > 0 || c.lastActive > deadline {
				continue
			}
			c.running = true
			c.stop = stopQueued
			items = append(items, stopItem{se: se, shard: n, id: id, c: c, idle: true})
		}
		se.mu.Unlock()
	}
	h.runStops(items)
	return len(items)
}

// passivateOverLimit starts stopping the least recently used idle entities
// (empty mailbox, no goroutine running them) until the host holds no more
// than MaxActive, counting those being stopped already, and returns how
// many it started. A busy entity is never chosen, so the host holds more
// than MaxActive while more than MaxActive are busy. A message that
// arrives before the Stop hook has begun cancels the passivation (the
// entity was used again). It does nothing when MaxActive is 0. The driver
// calls it often: under the limit it costs a lock per shard; over it, a
// sort of the idle entities by their last activity.
func (h *host) passivateOverLimit() int {
	if h.maxActive <= 0 {
		return 0
	}
	shards := h.snapshot()
	total := 0
	for _, se := range shards {
		se.mu.Lock()
		total += len(se.cells)
		se.mu.Unlock()
	}
	if total <= h.maxActive {
		return 0
	}
	type candidate struct {
		item stopItem
		last int64
	}
	var cands []candidate
	excess := total - h.maxActive
	for n, se := range shards {
		se.mu.Lock()
		for id, c := range se.cells {
			switch {
			case c.stop != stopNone || se.closing:
				excess-- // on its way out already
			case !c.running && len(c.mailbox) == 0 && c.entity != nil:
				cands = append(cands, candidate{stopItem{se: se, shard: n, id: id, c: c, idle: true, limit: true}, c.lastActive})
			}
		}
		se.mu.Unlock()
	}
	if excess <= 0 || len(cands) == 0 {
		return 0
	}
	slices.SortFunc(cands, func(a, b candidate) int { return cmp.Compare(a.last, b.last) })
	items := make([]stopItem, 0, min(excess, len(cands)))
	for _, cd := range cands {
		if len(items) == excess {
			break
		}
		it := cd.item
		it.se.mu.Lock()
		// Chosen outside the lock: take it only if it is still idle.
		if !it.se.closing && it.se.cells[it.id] == it.c && !it.c.running && len(it.c.mailbox) == 0 && it.c.entity != nil && it.c.stop == stopNone {
			it.c.running = true
			it.c.stop = stopQueued
			items = append(items, it)
		}
		it.se.mu.Unlock()
	}
	h.runStops(items)
	return len(items)
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
func (h *host) beginStop(shard int, se *shardEntities, items []stopItem) (<-chan struct{}, []stopItem) {
	se.mu.Lock()
	if !se.closing {
		se.closing = true
		se.drained = make(chan struct{})
		for id, c := range se.cells {
			if c.running {
				continue // its goroutine, or a queued passivation, stops it
			}
			c.running = true
			c.stop = stopQueued
			items = append(items, stopItem{se: se, shard: shard, id: id, c: c})
		}
	}
	drained := se.drained
	h.drainedLocked(se, shard)
	se.mu.Unlock()
	return drained, items
}

// stopShard stops every entity of shard: from now on deliveries to it are
// refused, messages already queued are handled, then the Stop hooks run and
// the entities are removed. It returns when all are stopped, or with ctx's
// error when ctx ends first (the stops then go on in the background). The
// driver unsubscribes the shard before calling it.
func (h *host) stopShard(ctx context.Context, shard int) error {
	h.mu.RLock()
	se := h.shards[shard]
	h.mu.RUnlock()
	if se == nil {
		return nil
	}
	drained, items := h.beginStop(shard, se, nil)
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
	for n, se := range h.snapshot() {
		var d <-chan struct{}
		d, items = h.beginStop(n, se, items)
		shards = append(shards, n)
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
	for _, se := range h.snapshot() {
		se.mu.Lock()
		n += len(se.cells)
		se.mu.Unlock()
	}
	return n
}

// shardEntities returns the sorted ids of the entities held for shard.
func (h *host) shardEntities(shard int) []string {
	h.mu.RLock()
	se := h.shards[shard]
	h.mu.RUnlock()
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
