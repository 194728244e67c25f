// Package protocol holds what every natshard component and every publisher
// must agree on: the shard function, the subject layout, the validation of
// names and entity ids, and the msgpack wire types of the control plane and
// of the KV records.
//
// # Shard function
//
// The shard of an entity is fnv1a32(utf8(id)) % N, which is exactly what the
// NATS server's subject-mapping function partition(N, i) computes for a
// single token. Publishers in any language can compute it, or let the server
// do it with a mapping such as
//
//	orders.* -> shard.orders.{{partition(128,1)}}.{{wildcard(1)}}
//
// # Subjects
//
// Data plane:    <data>.<type>.<shard>.<entity id...>   (default data prefix "shard")
// Control plane: <control>.<type>.<kind>...            (default control prefix "$SHARD")
//
// See Subjects for the full list. Nothing in this package does I/O.
package protocol
