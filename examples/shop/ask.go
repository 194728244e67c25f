package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/examples/cart"
	"github.com/natshard/natshard/examples/ratelimit"
)

// ask is the shop's client: it sends one request, as any service of the
// shop would, through natshard's typed references.
//
//	add <user> <item> [count]    if the user's rate limit allows it
//	get <user>
func ask(ctx context.Context, url string, args []string) error {
	if url == "" {
		url = nats.DefaultURL
	}
	nc, err := nats.Connect(url)
	if err != nil {
		return err
	}
	defer nc.Close()
	shop := natshard.NewClient(nc)

	req := cart.Request{Op: args[0]}
	switch {
	case req.Op == "add" && (len(args) == 3 || len(args) == 4):
		req.Item, req.Count = args[2], 1
		if len(args) == 4 {
			if req.Count, err = strconv.Atoi(args[3]); err != nil {
				return fmt.Errorf("count %q is not a number", args[3])
			}
		}
		limit, err := ratelimit.Key.Ref(shop, args[1]).Ask(ctx, ratelimit.Request{})
		if err != nil {
			return err
		}
		if !limit.Allowed {
			return errors.New("slow down: rate limit reached")
		}
	case req.Op == "get" && len(args) == 2:
	default:
		return errors.New("usage: shop [-nats URL] add <user> <item> [count] | get <user>")
	}
	c, err := cart.Key.Ref(shop, args[1]).Ask(ctx, req)
	if err != nil {
		return err
	}
	fmt.Println(c.Items)
	return nil
}
