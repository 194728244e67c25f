// Command shop is a node of a small shop: shopping carts (persistent) and
// a rate limiter (in memory), two natshard entity types in one process.
// Run one, then as many more as you like, then ask them:
//
//	go run ./examples/shop                                     # embedded NATS on 127.0.0.1:4222
//	go run ./examples/shop -nats nats://127.0.0.1:4222 -region b
//	go run ./examples/shop -nats nats://127.0.0.1:4222 add alice apple 2
//	go run ./examples/shop -nats nats://127.0.0.1:4222 get alice
//
// A node stops gracefully on Ctrl-C: its shards move to the others first.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/examples/cart"
	"github.com/natshard/natshard/examples/ratelimit"
)

func main() {
	var opts natshard.Options
	flag.StringVar(&opts.NATS, "nats", "", "NATS server URL; empty starts an embedded server")
	flag.StringVar(&opts.Region, "region", "", "this node's region id (default: host-pid)")
	flag.StringVar(&opts.Server.Listen, "listen", natshard.DefaultListen, "the embedded server's address")
	flag.StringVar(&opts.Server.DataDir, "data-dir", natshard.DefaultDataDir(), "the embedded server's store")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	var err error
	if flag.NArg() == 0 {
		err = natshard.Run(ctx, opts, cart.Type(), ratelimit.Type(5, 10))
	} else {
		err = ask(ctx, opts.NATS, flag.Args())
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "shop:", err)
		os.Exit(1)
	}
}
