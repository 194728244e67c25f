package jobs_test

import (
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/examples/jobs"
	"github.com/natshard/natshard/natshardtest"
)

// TestJobsThroughACrashAndAMove: a job's heartbeat (a periodic timer of
// the entity) beats while it runs; its shard moves, then the node that
// holds it crashes: the job is started again on the other node without a
// message (remembered) and beats again. A short job started meanwhile
// does each step once, in order, whatever the moves and crashes it went
// through.
func TestJobsThroughACrashAndAMove(t *testing.T) {
	c := natshardtest.Run(t, natshardtest.Config{Nodes: 2, Types: []natshard.Type{jobs.Type()}})
	ctx := t.Context()
	nc, err := nats.Connect(c.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	var beats atomic.Int64
	sub, err := nc.Subscribe(jobs.RunningSubject("long"), func(*nats.Msg) { beats.Add(1) })
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	ask := func(id string, req jobs.Request) jobs.Job {
		t.Helper()
		j, err := jobs.Key.Ref(c.Client(), id).Ask(ctx, req)
		if err != nil {
			t.Fatalf("%+v to %s: %v", req, id, err)
		}
		return j
	}
	get := jobs.Request{Op: "get"}
	ask("long", jobs.Request{Op: "start", Steps: 1, Every: jobs.Duration(time.Hour)}) // runs for the whole test
	ask("short", jobs.Request{Op: "start", Steps: 4, Every: jobs.Duration(time.Second)})
	c.Eventually("3 heartbeats", func() bool { return beats.Load() >= 3 })

	c.MoveEntity("job", "long", 1-c.OwnerOf("job", "long"))
	n := beats.Load()
	c.Eventually("heartbeats after the move", func() bool { return beats.Load() >= n+2 })

	c.Crash(c.OwnerOf("job", "long"))
	c.Settle()
	n = beats.Load()
	c.Eventually("heartbeats after the crash", func() bool { return beats.Load() >= n+2 })

	c.Eventually("the short job done", func() bool { return !ask("short", get).Running() })
	if j := ask("short", get); !slices.Equal(j.Done, []int{1, 2, 3, 4}) || !slices.Equal(j.Fired, []int{1, 2, 3, 4}) {
		t.Fatalf("job %+v: want steps 1 to 4 done once each, in order", j)
	}
}
