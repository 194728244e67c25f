package host

import (
	"context"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

// smallConn is a Publisher whose server takes at most max bytes: larger
// data fails as *nats.Conn fails it.
type smallConn struct {
	answers
	max int64
}

func (c smallConn) Publish(subject string, data []byte) error {
	if int64(len(data)) > c.max {
		return nats.ErrMaxPayload
	}
	return c.answers.Publish(subject, data)
}

func (c smallConn) MaxPayload() int64 { return c.max }

// TestAnswerTooLargeRefused: the runtime answers through the Publisher it
// was given; an answer larger than the server's max_payload is replaced
// by an error saying so (the requester does not time out), and the next
// answer goes out as usual. A plain publish gets no answer, even an
// error.
func TestAnswerTooLargeRefused(t *testing.T) {
	rec := newRecorder()
	f := func(context.Context, string) (Entity, error) {
		return &testEntity{handle: func(_ int, m *Message) ([]byte, error) {
			return []byte(strings.Repeat(string(m.Data), 2)), nil
		}}, nil
	}
	h := newTestHost(t, f, rec, func(c *Config) { c.Conn = smallConn{answers: rec.conn().(answers), max: 8} })
	h.Deliver(0, "a", req("a", "12345"))
	if r := rec.next(t); r.err == nil || !strings.Contains(r.err.Error(), "exceeds the NATS max_payload of 8 bytes") || r.subject != "_INBOX.x" {
		t.Fatalf("a too large answer: %+v, want an error saying so", r)
	}
	h.Deliver(0, "a", pub("a", "12345"))
	h.Deliver(0, "a", req("a", "ab"))
	if r := rec.next(t); string(r.data) != "abab" || r.err != nil {
		t.Fatalf("after the refusal: %+v", r)
	}
	if got := Answer(rec.conn(), &nats.Msg{Subject: "s"}, nil, Refused(protocol.RefusedMoving, context.Canceled)); got != nil {
		t.Fatalf("Answer to a plain publish: %v", got)
	}
	rec.none(t)
}
