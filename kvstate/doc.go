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
//
// Leases are keys with a per-key TTL. They are renewed by a publish to the
// key's subject that carries Nats-Expected-Last-Subject-Sequence (the
// holder's last revision) and Nats-TTL, because Update drops a key's TTL.
// Shard-table writes carry Nats-Expected-Last-Subject-Sequence-Subject set
// to the coordinator key's subject, so the server itself refuses the writes
// of a coordinator whose lease moved on.
//
// All NATS errors are translated into this package's sentinel errors in
// errors.go.
package kvstate
