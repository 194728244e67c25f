package natshard

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/natshard/natshard/coordinator"
	"github.com/natshard/natshard/internal/natstest"
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
	natstest.Eventually(t, 10*time.Second, "a subscription to "+coordinator.DisconnectSubject+" in the system account", func() error {
		sz, err := n.srv.Subsz(&server.SubszOptions{Account: "SYS", Test: "$SYS.ACCOUNT.$G.DISCONNECT"})
		if err == nil && sz.NumSubs == 0 {
			err = fmt.Errorf("%+v", sz)
		}
		return err
	})
	// A client without credentials lands in the application's account.
	c := NewClient(n.Conn())
	if _, err := c.Request(context.Background(), "t", "x", nil); err != nil {
		t.Fatal(err)
	}
}
