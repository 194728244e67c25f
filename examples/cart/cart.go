// Package cart is a persistent shopping cart, hosted as a natshard entity
// type: one entity per cart id, its contents saved in the type's KV bucket
// at every change, so a cart survives passivation, moves between processes
// and restarts.
//
// A cart answers JSON requests:
//
//	{"op":"add","item":"apple","count":2}     adds (count defaults to 1)
//	{"op":"set","item":"apple","count":5}     sets the count (0 removes)
//	{"op":"remove","item":"apple"}            removes the item
//	{"op":"get"}                              reads the cart
//
// with the whole cart, {"items":{"apple":2}}.
package cart

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/natshard/natshard"
)

// Cart is what a cart holds: its persisted state.
type Cart struct {
	Items map[string]int `json:"items"`
}

// Request is what a cart is asked.
type Request struct {
	Op    string `json:"op"`
	Item  string `json:"item,omitempty"`
	Count int    `json:"count,omitempty"`
}

// Type is the cart entity type.
func Type() natshard.Type {
	return natshard.Type{Name: "cart", Entity: New}
}

// New activates the cart id: it loads its saved state.
func New(ctx context.Context, id string) (natshard.Entity, error) {
	state, err := natshard.LoadState[Cart](ctx)
	if err != nil {
		return nil, err
	}
	return &entity{state: state}, nil
}

type entity struct {
	state *natshard.State[Cart]
}

// Handle answers one request. natshard calls it with one message at a time.
func (e *entity) Handle(ctx context.Context, m *natshard.Message) ([]byte, error) {
	var req Request
	if err := json.Unmarshal(m.Data, &req); err != nil {
		return nil, fmt.Errorf("bad request: %w", err)
	}
	var err error
	switch req.Op {
	case "get":
	case "add":
		if req.Item == "" {
			return nil, errors.New("bad request: add needs an item")
		}
		err = e.state.Update(ctx, func(c *Cart) error {
			if c.Items == nil {
				c.Items = map[string]int{}
			}
			c.Items[req.Item] += max(req.Count, 1)
			return nil
		})
	case "set", "remove":
		if req.Item == "" {
			return nil, fmt.Errorf("bad request: %s needs an item", req.Op)
		}
		err = e.state.Update(ctx, func(c *Cart) error {
			if req.Op == "remove" || req.Count <= 0 {
				delete(c.Items, req.Item)
				return nil
			}
			if c.Items == nil {
				c.Items = map[string]int{}
			}
			c.Items[req.Item] = req.Count
			return nil
		})
	default:
		return nil, fmt.Errorf("bad request: unknown op %q", req.Op)
	}
	if err != nil {
		return nil, err
	}
	return json.Marshal(e.state.Value())
}

// Stop has nothing to do: every change was saved when it was made.
func (e *entity) Stop(context.Context) error { return nil }
