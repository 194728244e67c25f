package kvstate_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// BenchmarkBufferAppend: appends of a 100-byte message with a Nats-Msg-Id
// to one shard's buffer on a single server, flushed at the end (one op is
// one message, until acknowledged): as the parking coordinator appends
// (Append), and as a pausing source does, naming its handoff for the
// fence (AppendFrom).
func BenchmarkBufferAppend(b *testing.B) {
	srv := natstest.RunServer(b)
	js := natstest.JetStream(b, natstest.Connect(b, natstest.URL(srv)))
	for _, c := range []struct {
		name   string
		append func(buf *kvstate.Buffer, m *nats.Msg)
	}{
		{"Append", func(buf *kvstate.Buffer, m *nats.Msg) { buf.Append(1, m, nil) }},
		{"AppendFrom", func(buf *kvstate.Buffer, m *nats.Msg) { buf.AppendFrom(1, 12345, m, nil) }},
	} {
		b.Run(c.name, func(b *testing.B) {
			subjects := protocol.MustSubjects("", "", "bench"+c.name)
			buf, err := kvstate.OpenBuffer(context.Background(), js, subjects, kvstate.BufferOptions{Timeout: time.Minute, MaxPerShard: 1 << 30})
			if err != nil {
				b.Fatal(err)
			}
			m := nats.NewMsg(subjects.Entity(1, "e"))
			m.Data = make([]byte, 100)
			m.Header.Set(protocol.HeaderMsgID, "x")
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				m.Header.Set(protocol.HeaderMsgID, string(rune('a'+i%26))+time.Duration(i).String())
				c.append(buf, m)
			}
			if err := buf.Flush(context.Background()); err != nil {
				b.Fatal(err)
			}
		})
	}
}
