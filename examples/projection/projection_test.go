package projection_test

import (
	"fmt"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/examples/projection"
	"github.com/natshard/natshard/natshardtest"
	"github.com/natshard/natshard/protocol"
)

// TestProjectionOutlivesItsProcesses: the projection's workers, on two
// nodes, apply every order's events in order, through a move of a
// worker's shard, a crash of a node and its restart: the status kept is
// always the order's last event.
func TestProjectionOutlivesItsProcesses(t *testing.T) {
	c := natshardtest.Run(t, natshardtest.Config{Nodes: 2, Types: []natshard.Type{projection.Daemon.Type()}})
	ctx := t.Context()
	nc, err := nats.Connect(c.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	publish := func(step int) {
		t.Helper()
		for o := range 20 {
			order := fmt.Sprintf("order-%d", o)
			// The NATS server's partition(4, order) is protocol.ShardOf.
			subject := fmt.Sprintf("orders.%d.%s", protocol.ShardOf(order, projection.Partitions), order)
			for e := 1; e <= 5; e++ {
				if _, err := js.Publish(ctx, subject, fmt.Appendf(nil, "step %d event %d", step, e)); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	applied := func(step int) {
		t.Helper()
		want := fmt.Sprintf("step %d event 5", step)
		c.Eventually(want+" applied to every order", func() bool {
			status, err := js.KeyValue(ctx, "order_status")
			if err != nil {
				return false
			}
			for o := range 20 {
				e, err := status.Get(ctx, fmt.Sprintf("order-%d", o))
				if err != nil || string(e.Value()) != want {
					return false
				}
			}
			return true
		})
	}
	c.Eventually("the ORDERS stream", func() bool { _, err := js.Stream(ctx, "ORDERS"); return err == nil })
	publish(1)
	applied(1)

	// Worker i lives in shard i: move worker 1 to the other node.
	c.Move("projection", 1, 1-c.Owner("projection", 1))
	publish(2)
	applied(2)

	owner := c.Owner("projection", 0)
	c.Crash(owner)
	publish(3)
	applied(3)
	c.Restart(owner)
	c.Settle()
	publish(4)
	applied(4)
}
