package natshard_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/natshard/natshard"
)

// greeter is an entity that counts the messages it handled.
type greeter struct {
	id   string
	seen int
}

func (g *greeter) Handle(_ context.Context, m *natshard.Message) ([]byte, error) {
	g.seen++
	return fmt.Appendf(nil, "hello %s from %s (message %d)", m.Data, g.id, g.seen), nil
}

func (g *greeter) Stop(context.Context) error { return nil }

// A node with an embedded NATS server hosts one entity type; its client
// sends to two entities of it.
func ExampleStart() {
	ctx := context.Background()
	dir, _ := os.MkdirTemp("", "natshard-example-")
	defer os.RemoveAll(dir)

	node, err := natshard.Start(ctx, natshard.Options{
		Server: natshard.ServerOptions{Listen: "127.0.0.1:0", DataDir: dir},
		Logger: slog.New(slog.DiscardHandler),
	}, natshard.Type{
		Name: "greeter",
		Entity: func(_ context.Context, id string) (natshard.Entity, error) {
			return &greeter{id: id}, nil
		},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer node.Stop(ctx)

	client := node.Client()
	for _, id := range []string{"fr", "fr", "en"} {
		answer, err := client.Request(ctx, "greeter", id, []byte("world"))
		fmt.Println(string(answer), err)
	}
	// Output:
	// hello world from fr (message 1) <nil>
	// hello world from fr (message 2) <nil>
	// hello world from en (message 1) <nil>
}

// Every process of a type must agree on what it stores: here, a second
// node hosts other entities under the type's name.
func ExampleStart_refused() {
	ctx := context.Background()
	dir, _ := os.MkdirTemp("", "natshard-example-")
	defer os.RemoveAll(dir)
	quiet := slog.New(slog.DiscardHandler)
	entity := func(_ context.Context, id string) (natshard.Entity, error) { return &greeter{id: id}, nil }

	first, err := natshard.Start(ctx, natshard.Options{
		Server: natshard.ServerOptions{Listen: "127.0.0.1:0", DataDir: dir}, Logger: quiet,
	}, natshard.Type{Name: "greeter", Entity: entity})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer first.Stop(ctx)

	_, err = natshard.Start(ctx, natshard.Options{NATS: first.ClientURL(), Logger: quiet},
		natshard.Type{Name: "greeter", Kind: "echo", Entity: entity})
	fmt.Println(strings.SplitAfter(err.Error(), "same kind")[0])
	// Output:
	// natshard: type "greeter": this process hosts entity kind "echo", the type's entities are of kind "greeter"; every process of a type must host the same kind
}
