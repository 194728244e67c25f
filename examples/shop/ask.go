package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/examples/cart"
	"github.com/natshard/natshard/examples/ratelimit"
)

// ask is the shop's client: it sends one request, as any service of the
// shop would, through natshard's client.
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
		var limit ratelimit.Answer
		if err := requestJSON(ctx, shop.Entity("ratelimit", args[1]), nil, &limit); err != nil {
			return err
		}
		if !limit.Allowed {
			return errors.New("slow down: rate limit reached")
		}
	case req.Op == "get" && len(args) == 2:
	default:
		return errors.New("usage: shop [-nats URL] add <user> <item> [count] | get <user>")
	}
	var c cart.Cart
	if err := requestJSON(ctx, shop.Entity("cart", args[1]), req, &c); err != nil {
		return err
	}
	fmt.Println(c.Items)
	return nil
}

// requestJSON sends req, JSON-encoded, to an entity and decodes its answer.
func requestJSON(ctx context.Context, e natshard.EntityRef, req, answer any) error {
	body, err := json.Marshal(req)
	if err != nil {
		return err
	}
	reply, err := e.Request(ctx, body)
	if err != nil {
		return err
	}
	return json.Unmarshal(reply, answer)
}
