// Package benchlab is natshard's benchmark harness: NATS servers
// (embedded, or one given by its URL), a System on them (regions and
// coordinator candidates, each a natshard node on a connection of its
// own, all in this process) and the workloads shardctl bench measures on
// it beside raw NATS or raw JetStream.
//
// Run is `shardctl bench`: cmd/shardctl parses the flags into a Config
// and prints the Result as a table or as JSON. The benchmarks of the
// bench/ directory build their systems with OpenServer and NewSystem too,
// and put their own probes (SystemConfig.Entity) and tracers around them.
//
// Files: config.go (the flags, validated), run.go (Run: a system per
// delivery mode), server.go and system.go (the harness), probe.go (what
// the entities handled), bench.go (publishers, requester and the raw
// side), throughput.go (the throughput rounds), requests.go (latency,
// concurrent callers and pipelined requests), failures.go (handoffs,
// region and coordinator crashes), best.go (raw JetStream in its best
// shape), loadlat.go (latency under load), profile.go (CPU profiles of
// each side), result.go (the figures, as the JSON names them),
// progress.go (the bar on stderr).
package benchlab
