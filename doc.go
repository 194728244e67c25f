// Package natshard is cluster sharding on NATS: entities (small stateful
// objects addressed by an id) of a type are grouped into shards, each shard
// is served by exactly one process at a time, one elected coordinator per
// type moves shards when processes join, leave, crash or become unbalanced,
// and messages sent while a shard moves are delayed, never lost. It does
// for Go services on NATS what Akka Cluster Sharding does on the JVM.
//
// # Typed entity types
//
// A Key names a type with the Go types of its requests and replies; a
// Handler per entity gets each request decoded (JSON by default, a Codec
// of one's own with WithCodec) and returns the reply; a Ref's Ask encodes,
// sends and decodes. Errors a type declares with NewError carry a code
// across the wire (the Natshard-Error-Code header), which errors.Is
// matches on the caller's side:
//
//	var Account = natshard.NewKey[Request, Reply]("account")
//	var ErrInsufficientFunds = natshard.NewError("insufficient-funds", "insufficient funds")
//
//	node, err := natshard.Start(ctx, opts, natshard.TypeOf(Account, newAccount))
//	...
//	reply, err := Account.Ref(client, "alice").Ask(ctx, Request{Op: "withdraw", Amount: 50})
//	if errors.Is(err, ErrInsufficientFunds) { ... }
//
// The wire stays plain: a request is the encoded value on the entity's
// subject, so any NATS client talks to a typed entity. Package send holds
// the sending half (Client, Key, Ref, Error) for programs that only send,
// without linking the NATS server; this package's names for them are
// aliases.
//
// # Hosting entities
//
// Underneath, a type is a name and a Factory; an Entity handles one
// message at a time, bytes in and bytes out:
//
//	node, err := natshard.Start(ctx, natshard.Options{NATS: "nats://127.0.0.1:4222"},
//		natshard.Type{Name: "cart", Entity: newCart},
//		natshard.Type{Name: "ratelimit", Entity: newLimiter, IdleTimeout: time.Minute})
//	...
//	defer node.Stop(ctx) // hands this process's shards to the others first
//
// Every process that calls Start with a type hosts a region of it, and is
// a candidate to coordinate it (Options.NoCoordinator says otherwise). With
// neither Options.Conn nor Options.NATS, Start runs an embedded NATS server
// with JetStream (Options.Server), which other processes can join. Run
// starts a node and stops it gracefully when its context ends.
//
// An entity is activated by its Factory on its first message and
// passivated when idle (Type.IdleTimeout); it may keep its state in the
// type's KV bucket, the typed way with State:
//
//	func newCart(ctx context.Context, id string) (natshard.Entity, error) {
//		state, err := natshard.LoadState[Cart](ctx)
//		...
//	}
//	// in Handle:
//	err := c.state.Update(ctx, func(cart *Cart) error { cart.Items[item]++; return nil })
//
// # Daemons
//
// A Daemon keeps N numbered workers running across the processes that
// host it, each once (Akka's sharded daemon process): worker i's Run
// goroutine runs in one process at a time, moves when processes join and
// leave, starts again elsewhere when its process dies, and N changes at
// run time (ScaleDaemon, shardctl scale):
//
//	var Projection = natshard.Daemon{Name: "projection", Workers: 4, Run: consumePartition}
//	node, err := natshard.Start(ctx, opts, Projection.Type())
//
// # Sending
//
// Any NATS client can publish to an entity's subject,
// shard.<type>.<shard>.<id>, where the shard is fnv1a32(id) % shards, the
// NATS server's own partition() mapping. A Client does it for Go:
//
//	c := natshard.NewClient(nc)
//	answer, err := c.Request(ctx, "cart", "alice", []byte(`{"op":"get"}`))
//
// A request is delayed, not failed, while its shard moves or has no owner
// for a moment; an entity's error comes back as an *EntityError.
//
// # Guarantees
//
// A shard is served by one process at a time: a process that loses its
// connection, or cannot renew its registration, stops serving at once. A
// planned move (a process joining or leaving, a rebalance, shardctl move)
// loses no message; messages with a key (Message.Key: a Nats-Msg-Id, or
// the reply subject of a Client's request) are handled once, others at
// least once. A crash loses the messages in the dead
// process and those published before its shards were parked (a few
// hundred milliseconds). docs/GUIDE.md walks through a first type,
// docs/PROTOCOL.md says how it works, docs/FAULTS.md what each fault
// costs (its "Guarantees" list them all).
//
// # Health
//
// Node.Healthy is a node's liveness and Node.Ready its readiness, on the
// model of Akka's sharding health check; package web serves them on
// /healthz and /readyz (docs/OPERATIONS.md, "Health").
//
// Healthy: the node serves (not stopped, not failed) and its NATS
// connection is up. A connection that is reconnecting is unhealthy, so a
// liveness probe should allow it some time (nats.go reconnects every
// 500 ms).
//
// Ready always checks that the node is healthy and not stopping, that
// each type's region is registered (a fenced region serves nothing until
// it registers again), and, on a member of an embedded cluster, that its
// server's JetStream is current with the cluster (nats-server's /healthz:
// its meta group and its replicas caught up), so that a rolling restart
// that waits for each member's readiness never takes down a second
// replica before the first caught up. Beyond that, a region is ready once
// the coordinator has taken it in (it obeyed one of its commands) and it
// replays no shard's buffer. Once that was true it stays true, so a
// coordinator failover or a move does not make every node unready; and
// after Options.ReadyAfter since the start it is not waited for any more
// (Akka's disabled-after), so that a rolling update cannot stall on a
// coordinator that does not come. A node that hosts only coordinator
// candidates (Options.NoRegion) is ready once connected.
package natshard
