// Package cart is a persistent shopping cart, hosted as a typed natshard
// entity type: one entity per cart id, its contents saved in the type's
// KV bucket at every change, so a cart survives passivation, moves between
// processes and restarts.
//
// Key names the type with its request and reply: a sender asks
//
//	rep, err := cart.Key.Ref(client, "alice").Ask(ctx, cart.Request{Op: "add", Item: "apple", Count: 2})
//
// and the wire is plain JSON, for any other language or `nats req`:
//
//	{"op":"add","item":"apple","count":2}     adds (count defaults to 1)
//	{"op":"set","item":"apple","count":5}     sets the count (0 removes)
//	{"op":"remove","item":"apple"}            removes the item
//	{"op":"get"}                              reads the cart
//
// with the whole cart, {"items":{"apple":2}}. A request it cannot take
// fails with natshard.ErrBadRequest (code "bad-request").
package cart

import (
	"context"

	"github.com/natshard/natshard"
)

// Cart is what a cart holds: its persisted state, and its answer.
type Cart struct {
	Items map[string]int `json:"items"`
}

// Request is what a cart is asked.
type Request struct {
	Op    string `json:"op"`
	Item  string `json:"item,omitempty"`
	Count int    `json:"count,omitempty"`
}

// Key is the cart type's: requests are Requests, replies Carts.
var Key = natshard.NewKey[Request, Cart]("cart")

// Type is the cart entity type.
func Type() natshard.Type { return natshard.TypeOf(Key, New) }

// New activates the cart id: it loads its saved state.
func New(ctx context.Context, id string) (natshard.Handler[Request, Cart], error) {
	state, err := natshard.LoadState[Cart](ctx)
	if err != nil {
		return nil, err
	}
	return &entity{state: state}, nil
}

type entity struct {
	state *natshard.State[Cart]
}

// Handle answers one request. natshard calls it with one request at a time.
func (e *entity) Handle(ctx context.Context, req Request) (Cart, error) {
	var change func(*Cart)
	switch {
	case req.Op == "get":
		return e.state.Value(), nil
	case req.Op != "add" && req.Op != "set" && req.Op != "remove":
		return Cart{}, natshard.ErrBadRequest.Errorf("unknown op %q", req.Op)
	case req.Item == "":
		return Cart{}, natshard.ErrBadRequest.Errorf("%s needs an item", req.Op)
	case req.Op == "add":
		change = func(c *Cart) { c.Items[req.Item] += max(req.Count, 1) }
	case req.Op == "remove" || req.Count <= 0:
		change = func(c *Cart) { delete(c.Items, req.Item) }
	default:
		change = func(c *Cart) { c.Items[req.Item] = req.Count }
	}
	// The reply is kept with the change for a request's idempotency key
	// (MsgID): sent again, after a move or a crash, it is not applied twice.
	return natshard.UpdateReply(ctx, e.state, func(c *Cart) (Cart, error) {
		if c.Items == nil {
			c.Items = map[string]int{}
		}
		change(c)
		return *c, nil
	})
}

// Answer is the reply the cart kept with its state for an idempotency
// key (UpdateReply): natshard looks there before calling Handle.
func (e *entity) Answer(key string) (natshard.KeptAnswer, bool) { return e.state.Answer(key) }
