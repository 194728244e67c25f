package region

import (
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
)

// Errors answered by the host to requests it cannot give to an entity.
var (
	// errShardNotServed answers a message delivered to a shard that is
	// being stopped (stopShard or stopAll began).
	errShardNotServed = errors.New("shard not served here")
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
	// IdleTimeout: passivateIdle stops entities idle this long; 0 means never.
	IdleTimeout time.Duration
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
	stopTimeout time.Duration
	log         *slog.Logger
	clock       func() time.Time
	replyFn     func(m *nats.Msg, data []byte, err error)

	epoch   time.Time     // lastActive values are offsets from it
	stopSem chan struct{} // bounds concurrent Stop hooks

	mu     sync.RWMutex
	shards map[int]*shardEntities
}

// shardEntities holds the cells of one shard. Lock order: a goroutine may
// take host.mu while holding shardEntities.mu, never the reverse.
type shardEntities struct {
	mu      sync.Mutex
	cells   map[string]*cell
	peak    int           // largest len(cells) since the map was last rebuilt
	closing bool          // stopShard began: deliveries are refused
	drained chan struct{} // closed when closing and cells is empty
	// delivered counts the messages queued for the shard's entities (see
	// load.go).
	delivered uint64
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
	mailbox    []*nats.Msg
	entity     Entity // nil until created, and after a stop or a panic
	lastActive int64  // nanoseconds since host.epoch
	running    bool   // a goroutine owns the cell
	stop       uint8
}

// newHost returns a host that holds no entity yet.
func newHost(cfg hostConfig) *host {
	if cfg.Factory == nil {
		panic("region: hostConfig.Factory is nil")
	}
	h := &host{
		factory:     cfg.Factory,
		idleTimeout: cfg.IdleTimeout,
		stopTimeout: cfg.StopTimeout,
		log:         cfg.Logger,
		clock:       cfg.Now,
		replyFn:     cfg.Reply,
		stopSem:     make(chan struct{}, maxConcurrentStops),
		shards:      make(map[int]*shardEntities),
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

// deliver queues m for entity id of shard and makes sure a goroutine runs
// the entity. It never waits for an entity. A shard being stopped refuses
// the message: a request is answered with errShardNotServed.
func (h *host) deliver(shard int, id string, m *nats.Msg) {
	se := h.shardFor(shard)
	se.mu.Lock()
	if se.closing {
		se.mu.Unlock()
		h.refuse(shard, id, m)
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
	c.mailbox = append(c.mailbox, m)
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
		h.shards[shard] = se
	}
	return se
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
	}
	h.mu.Unlock()
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
		}
		if len(c.mailbox) == 0 {
			if se.closing && ent != nil {
				// Deliveries are refused now, so the mailbox stays empty.
				se.mu.Unlock()
				h.stopEntity(shard, id, ent)
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
		m := c.mailbox[0]
		c.mailbox[0] = nil
		c.mailbox = c.mailbox[1:]
		se.mu.Unlock()

		handled = true
		if ent == nil {
			if ent = h.create(shard, id, m); ent == nil {
				continue
			}
		}
		if !h.handle(shard, id, ent, m) {
			ent = nil // panicked: drop this incarnation without Stop
		}
	}
}

// create calls the Factory for the message m; on failure it answers m and
// returns nil.
func (h *host) create(shard int, id string, m *nats.Msg) (ent Entity) {
	defer func() {
		if r := recover(); r != nil {
			h.log.Error("region: entity factory panicked",
				"shard", shard, "entity", id, "panic", fmt.Sprint(r), "stack", string(debug.Stack()))
			ent = nil
			h.reply(shard, id, m, nil, errEntityPanicked)
		}
	}()
	ent, err := h.factory(context.Background(), id)
	if err == nil && ent == nil {
		err = errors.New("entity factory returned no entity")
	}
	if err != nil {
		h.reply(shard, id, m, nil, fmt.Errorf("create entity: %w", err))
		return nil
	}
	return ent
}

// handle runs ent.Handle for m and answers it. It reports false when
// Handle panicked.
func (h *host) handle(shard int, id string, ent Entity, m *nats.Msg) (ok bool) {
	defer func() {
		if r := recover(); r != nil {
			h.log.Error("region: entity panicked",
				"shard", shard, "entity", id, "subject", m.Subject, "panic", fmt.Sprint(r), "stack", string(debug.Stack()))
			ok = false
			h.reply(shard, id, m, nil, errEntityPanicked)
		}
	}()
	data, err := ent.Handle(context.Background(), &Message{
		EntityID: id,
		Shard:    shard,
		Subject:  m.Subject,
		Reply:    m.Reply,
		Header:   m.Header,
		Data:     m.Data,
	})
	h.reply(shard, id, m, data, err)
	return true
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
			"shard", shard, "entity", id, "timeout", h.stopTimeout)
	}
}

// stopItem is a cell queued for a stop (passivation or shard stop).
type stopItem struct {
	se    *shardEntities
	shard int
	id    string
	c     *cell
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
			items = append(items, stopItem{se: se, shard: n, id: id, c: c})
		}
		se.mu.Unlock()
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
