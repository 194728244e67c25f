package host

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// keyed is a request to entity id with the idempotency key key.
func keyed(id, key, data string) *nats.Msg {
	m := req(id, data)
	m.Header = nats.Header{protocol.HeaderMsgID: {key}}
	return m
}

// TestKeyedMessagesAppliedOnce: a message sent again with its key is
// answered with the first answer (data or error) and not handled again;
// a key its sender marked unique (~) and a message without a key are
// handled each time; an error that may pass (kvstate.ErrUnavailable) is not kept;
// a request for the answer of a key (Natshard-Answer-Of) is answered with
// it, or refused (no-answer) when none is kept.
func TestKeyedMessagesAppliedOnce(t *testing.T) {
	rec := newRecorder()
	var n atomic.Int32
	f := func(context.Context, string) (Entity, error) {
		return &testEntity{handle: func(_ int, m *Message) ([]byte, error) {
			c := n.Add(1)
			switch string(m.Data) {
			case "fail":
				return []byte("no"), errors.New("refused by the entity")
			case "flaky":
				if c%2 == 1 {
					return nil, fmt.Errorf("save: %w", kvstate.ErrUnavailable)
				}
			}
			return fmt.Appendf(nil, "%s #%d", m.Data, c), nil
		}}, nil
	}
	h := New(Config{Factory: f, Logger: discardLogger(), Conn: rec.conn()})
	send := func(m *nats.Msg) captured {
		t.Helper()
		h.Deliver(0, "e", m)
		return rec.next(t)
	}
	first := send(keyed("e", "k1", "incr"))
	for range 2 {
		if again := send(keyed("e", "k1", "incr")); string(again.data) != string(first.data) || again.err != nil {
			t.Fatalf("sent again: %q, %v; want the first answer %q", again.data, again.err, first.data)
		}
	}
	if n.Load() != 1 {
		t.Fatalf("handled %d times, want once", n.Load())
	}
	failed := send(keyed("e", "k2", "fail"))
	if again := send(keyed("e", "k2", "fail")); string(again.data) != "no" || again.err == nil || again.err.Error() != failed.err.Error() {
		t.Fatalf("an error sent again: %q, %v; want %q, %v", again.data, again.err, failed.data, failed.err)
	}
	if n.Load() != 2 {
		t.Fatalf("handled %d times, want twice", n.Load())
	}
	// Not kept: an unavailable store's error, a unique key, no key.
	if a := send(keyed("e", "k3", "flaky")); !errors.Is(a.err, kvstate.ErrUnavailable) {
		t.Fatalf("flaky: %v", a.err)
	}
	if a := send(keyed("e", "k3", "flaky")); a.err != nil {
		t.Fatalf("flaky sent again after an unavailable store: %v, want handled again", a.err)
	}
	before := n.Load()
	send(keyed("e", "~unique", "x"))
	send(keyed("e", "~unique", "x"))
	send(req("e", "x"))
	send(req("e", "x"))
	if got := n.Load() - before; got != 4 {
		t.Fatalf("unique keys and no keys: handled %d times, want 4", got)
	}
	// Asking for an answer.
	ask := func(key string) *nats.Msg {
		m := req("e", "")
		m.Header = nats.Header{protocol.HeaderAnswerOf: {key}}
		return m
	}
	before = n.Load()
	if a := send(ask("k1")); string(a.data) != string(first.data) || a.err != nil {
		t.Fatalf("answer of k1: %q, %v", a.data, a.err)
	}
	if a := send(ask("never")); a.refused != protocol.RefusedNoAnswer {
		t.Fatalf("answer of a key never sent: %q, %v; want refused %s", a.data, a.err, protocol.RefusedNoAnswer)
	}
	if n.Load() != before {
		t.Fatal("a request for an answer was handled")
	}
	// The entity's own answers (AnswerKeeper) count too.
	h2 := New(Config{Factory: func(context.Context, string) (Entity, error) { return keeper{}, nil }, Logger: discardLogger(), Conn: rec.conn()})
	h2.Deliver(0, "e", keyed("e", "saved", "x"))
	if a := rec.next(t); string(a.data) != "kept" || a.err != nil {
		t.Fatalf("a key the entity keeps: %q, %v", a.data, a.err)
	}
	// An Answer that panics is a panic of the entity, answered so.
	h2.Deliver(0, "e", keyed("e", "boom", "x"))
	if a := rec.next(t); !errors.Is(a.err, errEntityPanicked) {
		t.Fatalf("a panicking Answer: %q, %v", a.data, a.err)
	}
}

// keeper keeps the answer "kept" for the key "saved", and fails any
// message it is given.
type keeper struct{}

func (keeper) Handle(context.Context, *Message) ([]byte, error) { return nil, errors.New("handled") }
func (keeper) Stop(context.Context) error                       { return nil }
func (keeper) Answer(key string) (KeptAnswer, bool) {
	if key == "boom" {
		panic("answer")
	}
	return KeptAnswer{Key: key, Data: []byte("kept")}, key == "saved"
}

// TestAnswersWindow: Answers keeps the last MaxKeys keys and their
// answers while they fit in MaxBytes (a dropped answer keeps its key),
// fewer keys only while the keys alone take more than MaxBytes, the last
// always; Encode and Decode
// round-trip (JSON, one line), and Decode refuses garbage.
func TestAnswersWindow(t *testing.T) {
	a := Answers{MaxKeys: 3, MaxBytes: 100}
	for i := range 5 {
		a.Add(KeptAnswer{Key: fmt.Sprint("k", i), Data: []byte("d")})
	}
	if _, ok := a.Get("k1"); ok || a.Len() != 3 {
		t.Fatalf("kept %d, k1 kept: %v; want the last 3", a.Len(), ok)
	}
	if ans, ok := a.Get("k4"); !ok || string(ans.Data) != "d" {
		t.Fatalf("k4: %+v %v", ans, ok)
	}
	a.Add(KeptAnswer{Key: "big", Data: []byte(strings.Repeat("x", 200))})
	for _, k := range []string{"k3", "k4", "big"} {
		// The large answer goes; the small ones, smaller than a key's
		// marker, stay whole.
		if ans, ok := a.Get(k); !ok || ans.Dropped != (k == "big") || a.Len() != 3 {
			t.Fatalf("after an answer larger than MaxBytes: %s %+v %v, %d kept; want the 3 keys, big without its answer", k, ans, ok, a.Len())
		}
	}
	if ans, _ := a.Get("big"); !errors.Is(ans.Err(), ErrAnswerDropped) {
		t.Fatalf("a dropped answer is sent as %v", ans.Err())
	}
	a.Add(KeptAnswer{Key: "err\nkey", Error: "bad\r\nthing"})
	if ans, ok := a.Get("err\nkey"); !ok || ans.Dropped {
		t.Fatalf("the last answer, small: %+v %v", ans, ok)
	}
	a.MaxBytes = 1000
	a.Add(KeptAnswer{Key: "k5", Data: []byte{0, 1, 2}})
	if a.Len() != 3 {
		t.Fatalf("%d kept, want 3", a.Len())
	}
	// Keys alone past MaxBytes: the oldest go, the last stays.
	c := Answers{MaxKeys: 10, MaxBytes: 50}
	for i := range 4 {
		c.Add(KeptAnswer{Key: fmt.Sprint("key-", strings.Repeat("k", 10), i), Data: []byte(strings.Repeat("d", 20))})
	}
	if _, ok := c.Get(fmt.Sprint("key-", strings.Repeat("k", 10), 0)); ok || c.Len() != 1 {
		t.Fatalf("keys of 15 bytes in a window of 50: %d kept; want 1", c.Len())
	}
	enc := a.Encode()
	if strings.ContainsAny(enc, "\r\n") {
		t.Fatalf("encoding with a line break: %q", enc)
	}
	b := Answers{MaxKeys: 3, MaxBytes: 1000}
	if err := b.Decode(enc); err != nil || b.Len() != 3 {
		t.Fatalf("decode: %d answers, %v", b.Len(), err)
	}
	if ans, ok := b.Get("k5"); !ok || string(ans.Data) != "\x00\x01\x02" {
		t.Fatalf("decoded: %+v %v", ans, ok)
	}
	if ans, ok := b.Get("err\nkey"); !ok || ans.Error != "bad\r\nthing" {
		t.Fatalf("decoded: %+v %v", ans, ok)
	}
	if err := b.Decode(`[{"key":`); !errors.Is(err, protocol.ErrMalformed) {
		t.Fatalf("garbage: %v", err)
	}
	if err := b.Decode(""); err != nil || b.Len() != 0 {
		t.Fatalf("empty: %d, %v", b.Len(), err)
	}
}
