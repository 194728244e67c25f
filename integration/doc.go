// Package integration holds natshard's multi-process tests: real shardd
// processes (built from this module by TestMain) against real NATS servers,
// started with random ports and temporary stores. They kill processes with
// SIGKILL where a crash matters and measure what they prove (re-home and
// failover times), printing the figures with t.Log.
//
// Run them with: go test ./integration/ (they are part of `go test ./...`).
//
// TestCampaign is the randomized fault campaign (docs/FAULTS.md,
// "Randomized fault campaign"): seeded faults on real processes and a
// history checker (internal/campaign). By default a short run of each
// delivery mode; -campaign.duration, -campaign.seeds and -campaign.modes
// (after -args) run long ones.
//
// TestChaos is the exception: it runs docker-compose.yml (images built by
// deploy/build) and faults its containers, needs a Docker engine, takes
// about three minutes, and runs only with NATSHARD_CHAOS=1, as .ci/run
// does; otherwise it is skipped, saying why.
package integration
