package cart_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/examples/cart"
)

// A node with an embedded NATS server hosts carts; a client fills one.
// The cart is saved at every change: a node started again on the same
// store finds it as it was.
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
	alice := node.Client().Entity("cart", "alice")
	for _, req := range []string{
		`{"op":"add","item":"apple","count":2}`,
		`{"op":"add","item":"pear"}`,
		`{"op":"remove","item":"apple"}`,
		`{"op":"buy"}`,
	} {
		answer, err := alice.Request(ctx, []byte(req))
		fmt.Printf("%s %v\n", answer, err)
	}
	node.Stop(ctx)

	node, err = natshard.Start(ctx, opts, cart.Type())
	if err != nil {
		panic(err)
	}
	defer node.Stop(ctx)
	answer, err := node.Client().Entity("cart", "alice").Request(ctx, []byte(`{"op":"get"}`))
	fmt.Printf("after a restart: %s %v\n", answer, err)
	// Output:
	// {"items":{"apple":2}} <nil>
	// {"items":{"apple":2,"pear":1}} <nil>
	// {"items":{"pear":1}} <nil>
	// {"error":"bad request: unknown op \"buy\"","ok":false} natshard: entity alice of type cart: bad request: unknown op "buy"
	// after a restart: {"items":{"pear":1}} <nil>
}
