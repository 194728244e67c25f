// Package integration holds natshard's multi-process tests: real shardd
// processes (built from this module by TestMain) against real NATS servers,
// started with random ports and temporary stores. They kill processes with
// SIGKILL where a crash matters and measure what they prove (re-home and
// failover times), printing the figures with t.Log.
//
// Run them with: go test ./integration/ (they are part of `go test ./...`).
//
// TestChaos is the exception: it runs docker-compose.yml (images built by
// deploy/build) and faults its containers, needs a Docker engine, takes
// about three minutes, and runs only with NATSHARD_CHAOS=1, as .ci/run
// does; otherwise it is skipped, saying why.
package integration
