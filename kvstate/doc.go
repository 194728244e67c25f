// Package kvstate is the only package that speaks JetStream KV: one bucket
// per entity type holds the type's configuration, the coordinator lease, the
// region registry, the shard table and the state of persistent entities.
//
// Keys:
//
//	config               protocol.TypeConfig (msgpack)
//	coordinator          protocol.CoordinatorInfo, lease with per-key TTL
//	regions.<id>         protocol.RegionInfo, lease with per-key TTL
//	shards.<n>           protocol.ShardRecord, fenced on the coordinator lease
//	entities.<escaped>   the entity's own bytes (see EntityKey)
//	streams-lock         held (with a TTL) while a process updates a durable
//	                     type's message streams (Store.LockStreams)
//
// Leases are keys with a per-key TTL. They are renewed by a publish to the
// key's subject that carries Nats-Expected-Last-Subject-Sequence (the
// holder's last revision) and Nats-TTL, because Update drops a key's TTL.
// Shard-table writes carry Nats-Expected-Last-Subject-Sequence-Subject set
// to the coordinator key's subject, so the server itself refuses the writes
// of a coordinator whose lease moved on.
//
// Consistency. A KV bucket's stream allows direct gets, which any replica
// answers, possibly before it applied the latest writes; kv.Get is never
// used. Single keys (Config, Coordinator, LoadEntity) are read with the
// non-direct STREAM.MSG.GET API request, which only the stream leader
// answers. Listings and the initial values of watches go through a KV
// watch, an ordered consumer the server may place on a follower; they are
// held back until the watch has delivered the last revision the leader
// reported for the watched keys when it began (see snapshot in watch.go).
//
// Compare-and-set on a replicated bucket. While a write checked against a
// subject is in flight, the server refuses further checked writes against
// that subject with error 10164 ("wrong last sequence", without checking).
// Such a refusal is decided by reading the checked key from the leader: the
// write is retried while its condition still holds. Writes fenced on the
// coordinator lease are moreover serialized within a Store.
//
// Expired TTLs leave a marker (Nats-Marker-Reason: MaxAge) that the bucket
// keeps for LimitMarkerTTL (markerTTL, five minutes); watches report it as
// a deletion. Watches end on any disconnection, after which they must be
// re-created.
//
// All NATS errors are translated into this package's sentinel errors in
// errors.go.
package kvstate
