// Package natstest runs in-process NATS servers with JetStream for tests:
// a single server (RunServer) or a cluster of n routed servers
// (RunCluster), on random ports of 127.0.0.1, each storing into its own
// t.TempDir(). Everything it starts is torn down with t.Cleanup, in reverse
// order of creation, so connections made with Connect close before the
// servers they point at shut down.
//
// The servers log nothing. Set NATSTEST_LOG=1 to see their logs.
package natstest
