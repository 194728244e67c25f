package main

import (
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/entities"
	"github.com/natshard/natshard/internal/natstest"
)

// TestRequestDurable: shardctl request to a type of durable delivery
// prints the entity's answer, as to a type of core delivery (a core
// request there would be answered by the stream's acknowledgement,
// {"stream":...,"seq":...}), and an entity's error exits 1 with it.
func TestRequestDurable(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	n, err := natshard.Start(context.Background(), natshard.Options{Conn: natstest.Connect(t, url), Region: "r1", Logger: slog.New(slog.DiscardHandler)},
		natshard.Type{Name: "kv", Entity: entities.KV(nil), Shards: 4, Delivery: natshard.Durable})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	out, stderr, err := ctl(t, url, "--type", "kv", "--timeout", "20s", "request", "order-42", `{"op":"incr","key":"items","by":2}`)
	if err != nil || out != "{\"ok\":true,\"value\":2}\n" {
		t.Fatalf("request: %q, %q, %v; want the entity's answer", out, stderr, err)
	}
	out, _, err = ctl(t, url, "--type", "kv", "--timeout", "20s", "request", "order-42", `{"op":"fly"}`)
	if err == nil || !strings.Contains(err.Error(), "entity answered with an error: bad request") || !strings.HasPrefix(out, `{"ok":false,"error":"bad request`) {
		t.Fatalf("an entity's error: %q, %v", out, err)
	}
}
