package region_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region"
)

// doubler answers every message with its payload twice.
type doubler struct{}

func (doubler) Handle(_ context.Context, m *region.Message) ([]byte, error) {
	return bytes.Repeat(m.Data, 2), nil
}
func (doubler) Stop(context.Context) error { return nil }

// TestAnswerTooLarge: an entity's answer larger than the server's
// max_payload cannot be sent; the requester gets an error saying so
// instead of a timeout, and the region keeps serving.
func TestAnswerTooLarge(t *testing.T) {
	nc := natstest.Connect(t, natstest.URL(natstest.RunServer(t)))
	js := natstest.JetStream(t, nc)
	ctx := context.Background()
	store, err := kvstate.Open(ctx, js, "kv", kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	subjects := protocol.MustSubjects("", "", "kv")
	buffer, err := kvstate.OpenBuffer(ctx, js, subjects, kvstate.BufferOptions{})
	if err != nil {
		t.Fatal(err)
	}
	agent, err := region.Open(ctx, region.Config{Conn: nc, Store: store, Buffer: buffer, Subjects: subjects, Shards: shards, ID: "r1",
		Factory: func(context.Context, string) (region.Entity, error) { return doubler{}, nil }})
	if err != nil {
		t.Fatal(err)
	}
	defer agent.Close(ctx)
	f := &fixture{nc: nc, store: store, buffer: buffer, subjects: subjects, agent: agent}
	regions, err := store.Regions(ctx)
	if err != nil || len(regions) != 1 {
		t.Fatalf("registration: %v %v", regions, err)
	}
	f.inc = regions[0].Info.Incarnation
	f.lease = newEpoch(t, store, kvstate.Lease{})
	f.epoch = f.lease.Revision
	if r := f.bind(t, f.epoch, 0, 1, 2, 3, 4, 5, 6, 7); r.Error != "" {
		t.Fatalf("bind: %s", r.Error)
	}

	subject := subjects.EntityOf("big", shards)
	big := make([]byte, nc.MaxPayload()/2+1)
	var reply []byte
	var hdr string
	deadline := time.Now().Add(10 * time.Second)
	for {
		msg, err := nc.Request(subject, big, 2*time.Second)
		if err == nil {
			reply, hdr = msg.Data, msg.Header.Get(protocol.HeaderError)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no answer to a request whose answer is too large: %v", err)
		}
	}
	if !strings.Contains(hdr, "exceeds the NATS max_payload") || !strings.Contains(string(reply), `"ok":false`) {
		t.Fatalf("answer %q with error header %q, want one saying it exceeds max_payload", reply, hdr)
	}
	if msg, err := nc.Request(subject, []byte("ab"), 2*time.Second); err != nil || string(msg.Data) != "abab" {
		t.Fatalf("after the refusal: %v", err)
	}
}
