package entities

import (
	"context"
	"strconv"
	"time"

	"github.com/nats-io/nuid"
	"github.com/natshard/natshard"
)

// DaemonKind is the built-in daemon kind of shardd (--kind daemon
// --workers N): a natshard.Daemon whose workers run Daemon.
const DaemonKind = "daemon"

// DaemonBeat is how often a worker of Daemon publishes that it runs.
const DaemonBeat = time.Second

// Daemon returns the Run of the built-in daemon kind, a diagnostic: each
// worker publishes, through its node's connection, a record on subject
// (default natshard.daemon.<type>) when its run starts, every DaemonBeat
// while it runs, and as it returns:
//
//	<worker> <region> <run> start
//	<worker> <region> <run> beat <n>
//	<worker> <region> <run> stop
//
// run is unique per run of a worker. Subscribing to subject shows where
// each worker runs, and since a run's stop is published before the run
// returns, and its next run starts only after that, the records of one
// worker on one NATS server never show two runs at once; the integration
// tests check it so, through kill -9 too.
func Daemon(subject string) func(ctx context.Context, index int) error {
	return func(ctx context.Context, index int) error {
		env := natshard.EnvFrom(ctx)
		subj := subject
		if subj == "" {
			subj = "natshard.daemon." + env.Type
		}
		prefix := strconv.Itoa(index) + " " + env.Region + " " + nuid.Next() + " "
		publish := func(what string) { _ = env.Conn.Publish(subj, []byte(prefix+what)) }
		publish("start")
		defer publish("stop")
		t := time.NewTicker(DaemonBeat)
		defer t.Stop()
		for n := 1; ; n++ {
			select {
			case <-ctx.Done():
				return nil
			case <-t.C:
				publish("beat " + strconv.Itoa(n))
			}
		}
	}
}
