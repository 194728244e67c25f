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

	client := node.Client()
	for _, key := range []string{"alice", "alice", "alice", "alice", "bob"} {
		answer, err := ratelimit.Key.Ref(client, key).Ask(ctx, ratelimit.Request{})
		fmt.Printf("%s: %+v %v\n", key, answer, err)
	}
	// Output:
	// alice: {Allowed:true Tokens:2} <nil>
	// alice: {Allowed:true Tokens:1} <nil>
	// alice: {Allowed:true Tokens:0} <nil>
	// alice: {Allowed:false Tokens:0} <nil>
	// bob: {Allowed:true Tokens:2} <nil>
}
