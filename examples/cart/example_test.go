package cart_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/examples/cart"
)

// A node with an embedded NATS server hosts carts; a typed reference fills
// one. The cart is saved at every change: a node started again on the
// same store finds it as it was.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "cart-example-")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	opts := natshard.Options{
		Server: natshard.ServerOptions{Listen: "127.0.0.1:0", DataDir: dir},
		Logger: slog.New(slog.DiscardHandler),
	}

	node, err := natshard.Start(ctx, opts, cart.Type())
	if err != nil {
		panic(err)
	}
	alice := cart.Key.Ref(node.Client(), "alice")
	for _, req := range []cart.Request{
		{Op: "add", Item: "apple", Count: 2},
		{Op: "add", Item: "pear"},
		{Op: "remove", Item: "apple"},
		{Op: "buy"},
	} {
		c, err := alice.Ask(ctx, req)
		fmt.Println(c.Items, err)
	}
	_, err = alice.Ask(ctx, cart.Request{Op: "buy"})
	fmt.Println("a bad request:", errors.Is(err, natshard.ErrBadRequest))
	node.Stop(ctx)

	node, err = natshard.Start(ctx, opts, cart.Type())
	if err != nil {
		panic(err)
	}
	defer node.Stop(ctx)
	c, err := cart.Key.Ref(node.Client(), "alice").Ask(ctx, cart.Request{Op: "get"})
	fmt.Println("after a restart:", c.Items, err)
	// Output:
	// map[apple:2] <nil>
	// map[apple:2 pear:1] <nil>
	// map[pear:1] <nil>
	// map[] natshard: entity alice of type cart: unknown op "buy"
	// a bad request: true
	// after a restart: map[pear:1] <nil>
}
