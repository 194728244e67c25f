package cart_test

import (
	"testing"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/examples/cart"
	"github.com/natshard/natshard/natshardtest"
)

// TestCartOutlivesItsProcess: a cart on two nodes keeps its contents
// through a passivation, a move of its shard, a crash of the node that
// holds it, and that node's restart: it is saved at every change.
func TestCartOutlivesItsProcess(t *testing.T) {
	c := natshardtest.Run(t, natshardtest.Config{Nodes: 2, Types: []natshard.Type{cart.Type()}})
	ctx := t.Context()
	ask := func(req string) string {
		t.Helper()
		answer, err := c.Client().Request(ctx, "cart", "alice", []byte(req))
		if err != nil {
			t.Fatalf("%s: %v", req, err)
		}
		return string(answer)
	}
	const want = `{"items":{"apple":2,"pear":1}}`
	ask(`{"op":"add","item":"apple","count":2}`)
	if got := ask(`{"op":"add","item":"pear"}`); got != want {
		t.Fatalf("cart %s, want %s", got, want)
	}

	c.Passivate("cart", "alice")
	if got := ask(`{"op":"get"}`); got != want {
		t.Fatalf("after a passivation: %s, want %s", got, want)
	}

	from := c.MoveEntity("cart", "alice", 1-c.OwnerOf("cart", "alice"))
	if got := ask(`{"op":"get"}`); got != want {
		t.Fatalf("after a move from node %d: %s, want %s", from, got, want)
	}

	owner := c.OwnerOf("cart", "alice")
	c.Crash(owner)
	c.Settle()
	if got := ask(`{"op":"get"}`); got != want {
		t.Fatalf("after a crash of node %d: %s, want %s", owner, got, want)
	}
	ask(`{"op":"remove","item":"apple"}`)

	c.Restart(owner)
	c.Settle()
	c.MoveEntity("cart", "alice", owner)
	if got := ask(`{"op":"get"}`); got != `{"items":{"pear":1}}` {
		t.Fatalf("after a restart and a move back: %s", got)
	}
}
