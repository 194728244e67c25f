// Package web serves a natshard node over HTTP: /metrics (Prometheus),
// /healthz and /readyz (probes), and /ui, a live map of the type's shards.
// shardd serves it on --http; a Go service serves it on a mux of its own:
//
//	reg := prometheus.NewRegistry()
//	node, err := natshard.Start(ctx, natshard.Options{Metrics: reg}, types...)
//	...
//	mux.Handle("/", web.New(node, web.Options{Gatherer: reg}))
//
// or mount it under a prefix with http.StripPrefix. A process that must
// answer probes before its node has started creates the handler with a
// nil node and calls SetNode once natshard.Start returned (shardd does):
// until then both probes answer 503 "starting". Given SetStartWait as
// natshard.Options.OnStartWait, it also says what Start waits for while
// JetStream is unavailable: /readyz answers 503 "starting: ... waiting for
// ..." and /healthz 200 (alive: Start gives up by itself after its start
// timeout).
//
// # Probes
//
// /healthz is Node.Healthy (the node serves and its NATS connection is
// up), /readyz is Node.Ready (each region registered, taken in by a
// coordinator and done replaying, on the model of Akka's sharding health
// check): 200 "ok", or 503 and the reason, as plain text.
//
// # The shard map
//
// /ui/ is one page (embedded; no build step): the shards of a type
// grouped by the region that holds them, each with its state (active,
// handoff, binding, parked) and owner, entities and message rates per
// region and shard, a region's detail (its shards and entity ids) on a
// click, and the coordinator's events as they come. Its data come from
// the node's NATS connection: the coordinator's status (every 2 s), each
// region's query answer (every 2 s) and the events subject, pushed to the
// page as server-sent events (/ui/api/events) and applied at once. The
// page is read-only. It shows what an admin user of the type sees
// (entity ids included): serve it where only operators reach it (shardd
// listens on loopback in the examples).
package web
