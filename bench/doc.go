// Package bench holds natshard's benchmarks of docs/BENCHMARKS.md's "Targets"
// that need a whole system in one process: an embedded NATS server with
// JetStream, several regions (each on its own connection) and a coordinator.
// The system is shardctl bench's (internal/benchlab: OpenServer,
// NewSystem); system_test.go adds the probes, the tracer and the publisher
// these benchmarks measure with.
//
// The package has test files only. `go test ./bench/` runs one cheap test
// that exercises every scenario once with tiny sizes; the benchmarks run
// only when asked for:
//
//	go test -run '^$' -bench BenchmarkHandoff -benchtime 100x ./bench/
//	go test -run '^$' -bench BenchmarkRebalanceDip -benchtime 1x ./bench/
//	go test -run '^$' -bench BenchmarkIdleEntities -benchtime 1x ./bench/
//	go test -run '^$' -bench BenchmarkRegions -benchtime 1x ./bench/
//	go test -run '^$' -bench BenchmarkDurableShapes -benchtime 1x ./bench/
//
// Figures are reported with b.ReportMetric as percentiles over many
// samples and as ratios, never asserted: the machines they run on are
// small and shared. See docs/BENCHMARKS.md for the figures measured and
// what they mean.
//
// Flags, after the package on the go test command line (give values with
// "=", e.g. -natshard.rate=5000):
//
//	-natshard.rate N         messages/s of BenchmarkHandoff's publisher (2000)
//	-natshard.dip-rate N     messages/s of BenchmarkRebalanceDip's publisher (3000)
//	-natshard.min-samples N  moves BenchmarkHandoff measures at least (20)
//	-natshard.idle-entities N  entities BenchmarkIdleEntities activates (1 000 000)
//	-natshard.report=FILE    append the full reports (timelines, windows) to FILE
//	-natshard.log            log regions and coordinator at debug level to stderr
package bench
