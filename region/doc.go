// Package region hosts the shards of one entity type in one process.
//
// An Agent registers the region in the type's KV bucket with a lease,
// answers the coordinator's commands on its command subject, subscribes to
// shard.<type>.<n>.> for each shard the current coordinator told it to bind,
// and dispatches each message to its entity.
//
// # Core and driver
//
// Core (core.go, corereg.go, coresuspend.go) owns the region's state:
// what it does with its shards and its registration. It takes events (the
// coordinator's commands, an epoch check's outcome, shards bound, a
// replay caught up, entities stopped, a release done, a registration or
// renewal written or refused, the shard table read, a fence, a lost
// connection and the connection back, a leave, a close, and ticks that
// carry the time) and returns the actions to carry out, in order. It does
// no I/O and reads no clock: time comes in with Tick and with the outcome
// events, deadlines are package renewal's. Its tests are scenarios
// without NATS (core_test.go, corereg_test.go) and a simulation of random
// histories that checks the region's guarantees after every step
// (sim_test.go).
//
// The registration life cycle is the core's: it registers (Open waits for
// the first registration; a late acknowledgement is written again as the
// same incarnation), renews every LeaseTTL/4 (at most 1 s) with one write
// in flight at a time, fences on a conflict or once the deadline (3/4 of
// LeaseTTL after the last renewal was sent) passed with no renewal in
// flight, suspends when the deadline passes with one unanswered, registers
// a new incarnation after a fence, suspends at a lost connection and
// confirms its shards once back (a renewal, then a read of the shard
// table, made again if another drop overtook it), and marks itself leaving.
//
// The driver (driver.go, Agent.run) is the one goroutine that owns the
// core: it steps it with the events posted to it and a tick every 50 ms,
// publishes an immutable view of the core (registered, suspended, closing,
// leaving, incarnation, epoch, held shards and their modes) for Serving,
// Status and queries, and carries the actions out, running the slow ones
// (an epoch check, a flush, a release, stopping entities, the registration
// writes and the table read of register.go) in goroutines that post their
// outcome back as events. Agent.Fence, Suspend, Reconnected, Leave and
// Close post events; Fence and Suspend return once the driver carried
// theirs out. Every fact of the region's state has one writer: the core.
// The data plane (intake.go, shards.go, replay.go) serves the shards'
// messages under each shard's lock, in the mode the core set.
//
// Entities are created on their first message by a Factory, handle their
// messages one at a time in arrival order, run concurrently with each other
// and are passivated when idle. An idle entity costs a map entry and a small
// struct: no goroutine lives for it. That is the entity runtime, the package
// internal/host below this one (mailboxes, workers, passivation, the
// active-entity limit, timers, the answers kept for keyed messages): the
// data plane hands each message over in one call (Host.Deliver, under the
// shard's lock) and the runtime answers the request itself through the
// connection, to the message's reply subject. Entity, Message and the
// other types an entity sees are that package's, named here by aliases.
//
// # Locks
//
// The driver's facts need no lock: the core, the intakes of the held
// shards by number and the stops under way by shard (Agent.shards and
// stopping) are touched by the driver alone; a goroutine working for a
// shard is given its intake, and goroutines report by posting events.
// The view the driver publishes, the layout, the counters (Stats), the
// load meter, the restart pacer and the log limiter are atomics; the
// entity recorder's batch is its goroutine's, fed through a channel.
// Four mutexes remain. The first three guard what a shard's message path
// reads at every message, which no event could carry without a round
// trip through the driver per message; the fourth, the subscriptions,
// which a release's goroutine changes too:
//
//   - shardState.mu (core delivery, one per held shard): the shard's mode
//     and what goes with it (held arrivals, replayed keys, the handoff).
//     The subscription's callback, the replay, the clearing of a paused
//     shard and the driver's mode changes take it; every delivery to the
//     entities happens under it, so that once the driver changed the mode
//     no message of the old mode reaches an entity. It is the only lock
//     the region adds on a message's way (then the runtime's, host).
//   - streamShard.mu (durable delivery, one per held shard): the same for
//     the pull: mode, iterator, consumer, expected sequence. The pull's
//     goroutine and the driver take it.
//   - streamShard.ackMu: the last message handled, which the entities'
//     workers acknowledge in turn (handled) and a pause or a split
//     confirms (confirm): an acknowledgement confirmed comes after every
//     one sent before it. Kept apart from mu so that acknowledging never
//     waits for the pull.
//   - Agent.subsMu: the region's subscriptions by subject and the changes
//     of their routes (subjects.go). The driver binds, drops and splits
//     under it; a release's goroutine takes its drained shard off its
//     subscriptions under it (and the shard's lock) the moment they
//     caught up, then writes the end marker: through the driver, that
//     would wait for its turn (behind a split of a thousand shards, say)
//     and for a driver that Close may have stopped already.
//
// Lock order: a shard's lock, then subsMu; a shard's lock, then the
// runtime's (internal/host).
//
// # Handoff
//
// Each held shard is in one of three modes (shards.go):
//
//   - replaying (Bind): subscribed; the shard's buffer is replayed to the
//     entities up to the end marker of the bind's handoff id while new
//     arrivals are held in memory (at most Config.MaxHeld); at the marker the
//     held messages are delivered, except those whose key (Nats-Msg-Id, or
//     a reply subject marked unique: protocol.MessageKey) was replayed,
//     the shard goes live and the buffer is purged up to the marker
//     (and before, behind the replay, as its entities handle what it
//     delivered: replaytrail.go);
//   - live: arrivals go straight to the entities;
//   - paused (HandOff): arrivals are appended to the shard's buffer, naming
//     the handoff, and the entities stop; Release keeps diverting for
//     Config.ReleaseGrace, drains the subscription (what it received is
//     still buffered), forgets the shard and appends the end marker. A
//     pause that finds its handoff fenced in the buffer (the coordinator
//     took the shard while this region did not run) drops the shard.
//
// # Zombies
//
// A region that did not run for Config.StallLimit (its process stopped, a
// long GC pause, a VM stall), or passed its registration deadline, may
// have lost shards meanwhile: it suspends its live shards until it has
// confirmed them against the shard table, as after a lost connection; the
// messages queued for its entities before the stall wait for the
// confirmation: handled if it keeps their shard, dropped unanswered if it
// drops it, since a replayed one is still in the buffer its next owner
// replays (host.Deliver; stall.go; PROTOCOL.md, Zombie regions).
//
// Drop, Fence and Close end any mode at once, without end marker. The mode
// changes under the shard's lock and every delivery to the entities happens
// under it, so once a shard left live (or replaying) none of its messages
// reaches an entity of this region. Every command is idempotent; a Release
// of a shard that is live or replaying, and a Bind of a paused shard, are
// refused as coordinator errors. Messages refused on the way (buffer full,
// too many held while the shard pauses) are counted in Stats, logged at
// most every 10 s per kind and, for a request, answered with the
// Natshard-Error header. Those of a shard that left without a handoff
// (held, or still in its subscription), and those beyond MaxHeld while it
// replays or is suspended, are counted and logged but not answered:
// another holder of the shard may have a copy and answer it.
//
// Leave (and the leave command) marks the region leaving in its
// registration, at once and in every renewal after; the coordinator then
// hands its shards off, and Leave returns once none is held.
package region
