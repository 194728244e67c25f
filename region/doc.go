// Package region hosts the shards of one entity type in one process.
//
// An Agent registers the region in the type's KV bucket with a lease,
// answers the coordinator's commands on its command subject, subscribes to
// shard.<type>.<n>.> for each shard the current coordinator told it to bind,
// and dispatches each message to its entity.
//
// Entities are created on their first message by a Factory, handle their
// messages one at a time in arrival order, run concurrently with each other
// and are passivated when idle. An idle entity costs a map entry and a small
// struct: no goroutine lives for it.
package region
