package ratelimit_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/examples/ratelimit"
)

// A limiter of bursts of 3 that refills one token every 1000 s: each key
// gets its first 3 requests, then none; keys are counted apart.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "ratelimit-example-")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	node, err := natshard.Start(ctx, natshard.Options{
		Server: natshard.ServerOptions{Listen: "127.0.0.1:0", DataDir: dir},
		Logger: slog.New(slog.DiscardHandler),
	}, ratelimit.Type(0.001, 3))
	if err != nil {
		panic(err)
	}
	defer node.Stop(ctx)

	limits := node.Client()
	for _, key := range []string{"alice", "alice", "alice", "alice", "bob"} {
		answer, err := limits.Request(ctx, "ratelimit", key, nil)
		fmt.Printf("%s: %s %v\n", key, answer, err)
	}
	// Output:
	// alice: {"allowed":true,"tokens":2} <nil>
	// alice: {"allowed":true,"tokens":1} <nil>
	// alice: {"allowed":true,"tokens":0} <nil>
	// alice: {"allowed":false,"tokens":0} <nil>
	// bob: {"allowed":true,"tokens":2} <nil>
}
