// Package natstest runs in-process NATS servers with JetStream for tests:
// a single server (RunServer) or a cluster of n routed servers
// (RunCluster), on random ports of 127.0.0.1, each storing into its own
// t.TempDir(). Everything it starts is torn down with t.Cleanup, in reverse
// order of creation, so connections made with Connect close before the
// servers they point at shut down.
//
// Eventually is the one wait of natshard's tests: it polls a condition
// until it holds, failing the test after a generous bound; a test waits on
// conditions, never on a clock.
//
// The servers log nothing. Set NATSTEST_LOG=1 to see their logs.
package natstest
