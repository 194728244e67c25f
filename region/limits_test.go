package region_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/natshard/natshard/internal/natstest"
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
	f := newFixtureWith(t, func(context.Context, string) (region.Entity, error) { return doubler{}, nil })
	nc := f.nc
	if r := f.bind(t, f.epoch, 0, 1, 2, 3, 4, 5, 6, 7); r.Error != "" {
		t.Fatalf("bind: %s", r.Error)
	}

	subject := f.subjects.EntityOf("big", shards)
	big := make([]byte, nc.MaxPayload()/2+1)
	var reply []byte
	var hdr string
	natstest.Eventually(t, 10*time.Second, "an answer to a request whose answer is too large", func() error {
		msg, err := nc.Request(subject, big, 2*time.Second)
		if err == nil {
			reply, hdr = msg.Data, msg.Header.Get(protocol.HeaderError)
		}
		return err
	})
	if !strings.Contains(hdr, "exceeds the NATS max_payload") || !strings.Contains(string(reply), `"ok":false`) {
		t.Fatalf("answer %q with error header %q, want one saying it exceeds max_payload", reply, hdr)
	}
	if msg, err := nc.Request(subject, []byte("ab"), 2*time.Second); err != nil || string(msg.Data) != "abab" {
		t.Fatalf("after the refusal: %v", err)
	}
}
