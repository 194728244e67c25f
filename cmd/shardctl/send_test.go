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
// {"stream":...,"seq":...}), and an entity's error exits 1 with it. With
// --key, a request or a message sent again is applied once.
func TestRequestDurable(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	n, err := natshard.Start(context.Background(), natshard.Options{Conn: natstest.Connect(t, url), Region: "r1", Logger: slog.New(slog.DiscardHandler)},
		natshard.Type{Name: "kv", Entity: entities.KV(nil), Shards: 4, Delivery: natshard.Durable},
		natshard.Type{Name: "kvc", Entity: entities.KV(nil), Shards: 4})
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
	// --key: sent twice, applied once, the first answer twice; in both
	// delivery modes.
	for _, typ := range []string{"kv", "kvc"} {
		for i := range 2 {
			out, _, err := ctl(t, url, "--type", typ, "--timeout", "20s", "request", "k", `{"op":"incr","key":"n"}`, "--key", "op-1")
			if err != nil || out != "{\"ok\":true,\"value\":1}\n" {
				t.Fatalf("type %s, request %d with --key: %q, %v; want the first answer", typ, i+1, out, err)
			}
		}
		if _, _, err := ctl(t, url, "--type", typ, "send", "k", `{"op":"incr","key":"n"}`, "--key", "op-1"); err != nil {
			t.Fatal(err)
		}
		out, _, err := ctl(t, url, "--type", typ, "--timeout", "20s", "request", "k", `{"op":"get","key":"n"}`)
		if err != nil || out != "{\"ok\":true,\"value\":1}\n" {
			t.Fatalf("type %s after three sends of one key: %q, %v; want n = 1", typ, out, err)
		}
	}
}
