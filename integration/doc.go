// Package integration holds natshard's multi-process tests: real shardd
// processes (built from this module by TestMain) against real NATS servers,
// started with random ports and temporary stores. They kill processes with
// SIGKILL where a crash matters and measure what they prove (re-home and
// failover times), printing the figures with t.Log.
//
// Run them with: go test ./integration/ (they are part of `go test ./...`).
package integration
