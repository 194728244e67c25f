package kvstate_test

import (
	"context"
	"errors"
	"testing"

	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
)

// Bind never creates a bucket: inspecting an unknown type must not make it
// exist.
func TestBindDoesNotCreate(t *testing.T) {
	srv := natstest.RunServer(t)
	js := natstest.JetStream(t, natstest.Connect(t, natstest.URL(srv)))
	ctx := context.Background()
	if _, err := kvstate.Bind(ctx, js, "ghost", kvstate.Options{}); !errors.Is(err, kvstate.ErrNotFound) {
		t.Fatalf("Bind of a type without bucket: %v, want ErrNotFound", err)
	}
	if _, err := js.KeyValue(ctx, kvstate.BucketName("ghost")); err == nil {
		t.Fatal("Bind created the bucket")
	}
	if _, err := kvstate.Open(ctx, js, "ghost", kvstate.Options{}); err != nil {
		t.Fatal(err)
	}
	if _, err := kvstate.Bind(ctx, js, "ghost", kvstate.Options{}); err != nil {
		t.Fatalf("Bind after Open: %v", err)
	}
}
