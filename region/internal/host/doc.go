// Package host is the entity runtime of a region: the entities of the
// shards the region serves, their mailboxes, the workers that run them,
// their activation and passivation (idle, over the active-entity limit,
// asked for by the entity), the stop of a shard's entities, their timers
// and the answers they keep for keyed messages.
//
// It is below region and knows nothing of shard modes, handoffs or the
// coordinator: region decides whether a message reaches an
// entity (its shard's mode, under the shard's lock) and hands it over
// with Deliver (DeliverDurable in durable delivery); from there the
// runtime runs it and answers the request itself, through the Publisher
// it was given (Config.Conn, the region's NATS connection), to the reply
// subject the message carries. Nothing calls back up into region on the
// message path but the optional hooks of Config (Stalls, Trace,
// Remember, Forget). It is internal to region: region.Entity,
// region.Message and the other types entities see are aliases of this
// package's.
//
// # The message path
//
// A message of core delivery to a live shard crosses two goroutines:
//
//   - the subscription's (region): onSubject, dispatch (shardState.mu),
//     Host.Deliver: enqueue appends it to its entity's cell and, if the
//     cell was idle, schedule puts the cell on the ready queue and wakes
//     or starts a worker;
//   - a worker's (worker, run): it takes the cell's mailbox as a batch,
//     deliverOne creates the entity if needed and calls Handle (handle),
//     and reply answers through Config.Conn (Answer).
//
// # Locks on the way in
//
// Deliver takes at most these four locks, each released before the next
// is taken except limitMu, taken under the shard's mutex (the lock order
// of the package: a shard's mutex, then Host.mu or limitMu; Host.qmu
// alone):
//
//  1. the shard's mutex (shardEntities.mu), always: it guards the shard's
//     cells (map, mailbox, running flag) and counts. It is per shard, so
//     that messages of different shards do not contend, and it is what
//     makes a message either join a running cell's mailbox or make the
//     cell ready, never both or neither.
//  2. Host.qmu, only when the cell was idle (a message to an entity that
//     is running or has messages queued takes no other lock): it guards
//     the ready queue and the count of searching workers, which must
//     change together so that a queued cell always has a worker coming.
//  3. limitMu, only with MaxActive, on a cell's first message and once
//     per touchBatch messages of a shard (touchLimit): the limit's policy
//     is shared by every shard.
//  4. Host.mu, only for the first message of a shard the host does not
//     hold yet (shardFor, before the shard's mutex); the lookup of a held
//     shard takes no lock (shardTable).
//
// So a message to a busy entity takes one lock of the runtime, one to an
// idle entity two. (The region holds its shard's lock, shardState.mu,
// around Deliver, so that once a shard left live none of its messages
// reaches an entity: that is the region's lock, taken before these.) A
// worker takes the shard's mutex once per batch (and once more per
// message with an idempotency key, a timer or an entity not remembered
// yet), Host.qmu once per turn of a cell, and no lock to answer (the
// Publisher's own, *nats.Conn's, to publish).
//
// # Execution
//
// Each entity lives in a cell: a FIFO mailbox (a pooled mailq, nil while
// the cell is idle), a running flag, the Entity (nil until the Factory
// made it) and the time of its last activity. Deliver appends the message
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
// A Flusher's messages of durable delivery are handled in runs
// (flush.go): the worker applies them with Handle, calls Flush once
// after the batch (at most MaxRun messages, ending early before a
// message that is not of durable delivery or repeats a key of the run),
// and only then keeps their answers, answers and acknowledges them. A
// failed run drops the incarnation and its messages are handled again
// one at a time, each with its own Flush. A message of durable delivery
// whose shard's context has ended is not handled: it stays in the
// stream, with every later one.
//
// So an entity handles one message at a time, different entities run
// concurrently, and an idle entity costs its cell and map entry, never a
// goroutine. Mailboxes are unbounded: back-pressure is the caller's
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
// PassivateIdle stops entities that have been idle for IdleTimeout. The stop
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
// Each shard has a context, the parent's (Config.Context) child: the
// Factory and Handle of its entities get it. It ends when the shard's
// entities have all stopped, or at once when AbortShard is called (the
// region calls it when the shard is dropped or the region fenced or
// closed: the shard may already be another region's). A handoff leaves it
// alone until the entities have stopped, so that they finish the messages
// they were given.
//
// # Stopping shards
//
// StopShard refuses new deliveries to the shard (errShardNotServed), lets
// every entity finish the messages already in its mailbox, runs the Stop
// hooks (at most maxConcurrentStops at a time in the host, each bounded by
// StopTimeout) and removes the entities. When it is done the shard is
// forgotten: a later Deliver to it (the shard was bound again) starts
// afresh. A Stop hook that outlives StopTimeout is abandoned (left running
// in its goroutine) and its entity counts as stopped: a new incarnation may
// then be created while the old hook still runs.
package host
