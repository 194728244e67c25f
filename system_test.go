package natshard

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/natshard/natshard/coordinator"
)

type nopEntity struct{}

func (nopEntity) Handle(context.Context, *Message) ([]byte, error) { return nil, nil }
func (nopEntity) Stop(context.Context) error                       { return nil }

// TestEmbeddedSystemAccount: a node with the embedded server reads the
// server's disconnect advisories on its system account (so that its
// coordinator finds a dead region at once), while clients without
// credentials still reach the application's account.
func TestEmbeddedSystemAccount(t *testing.T) {
	n, err := Start(context.Background(), Options{
		Server: ServerOptions{Listen: "127.0.0.1:0", DataDir: t.TempDir()}, Logger: slog.New(slog.DiscardHandler),
	}, Type{Name: "t", Shards: 2, Entity: func(context.Context, string) (Entity, error) { return nopEntity{}, nil }})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close(context.Background())
	if n.disconnect == nil || n.sys == nil {
		t.Fatal("no connection to the system account")
	}
	// The coordinator subscribed to the advisories (it leads: it is the
	// only candidate).
	deadline := time.Now().Add(10 * time.Second)
	for {
		sz, err := n.srv.Subsz(&server.SubszOptions{Account: "SYS", Test: "$SYS.ACCOUNT.$G.DISCONNECT"})
		if err == nil && sz.NumSubs > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no subscription to %s in the system account: %+v %v", coordinator.DisconnectSubject, sz, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// A client without credentials lands in the application's account.
	c := NewClient(n.Conn())
	if _, err := c.Request(context.Background(), "t", "x", nil); err != nil {
		t.Fatal(err)
	}
}
