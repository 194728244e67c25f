package natshard_test

import (
	"context"
	"runtime"
	"strconv"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
)

// BenchmarkRequest: what a caller's side of a core request costs, 64
// callers at once on one connection, all answered by one plain
// responder (a subscription on the type's subjects answering at once):
// natshard.Client.Request beside nc.Request to the same subjects. The
// responder and the server are the same for both, so what differs is
// the caller's work (shardctl bench's 64 callers measure the whole path,
// regions included). Run with
//
//	go test -run '^$' -bench BenchmarkRequest -benchmem -count 5 .
func BenchmarkRequest(b *testing.B) {
	url := natstest.URL(natstest.RunServer(b))
	subjects := newType(b, url, "bench", 128)
	responder := natstest.Connect(b, url)
	if _, err := responder.Subscribe(subjects.AllData(), func(m *nats.Msg) { _ = m.Respond(m.Data) }); err != nil {
		b.Fatal(err)
	}
	if err := responder.Flush(); err != nil {
		b.Fatal(err)
	}
	nc := natstest.Connect(b, url)
	client := natshard.NewClient(nc)
	ids := make([]string, 1000)
	raw := make([]string, len(ids))
	for i := range ids {
		ids[i] = "e" + strconv.Itoa(i)
		raw[i] = subjects.EntityOf(ids[i], 128)
	}
	ctx := context.Background()
	if _, err := client.Request(ctx, "bench", ids[0], nil); err != nil { // learns the type
		b.Fatal(err)
	}
	body := make([]byte, 128)
	for _, side := range []struct {
		name    string
		request func(i int) error
	}{
		{"client", func(i int) error {
			_, err := client.Request(ctx, "bench", ids[i], body)
			return err
		}},
		{"nc.Request", func(i int) error {
			_, err := nc.Request(raw[i], body, natshard.DefaultTimeout)
			return err
		}},
	} {
		b.Run(side.name, func(b *testing.B) {
			b.SetParallelism(64 / max(1, runtime.GOMAXPROCS(0)))
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				i := 0
				for pb.Next() {
					i = (i + 1) % len(ids)
					if err := side.request(i); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}
