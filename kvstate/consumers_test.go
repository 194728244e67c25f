package kvstate_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// TestConsumerRoom: the buffer and the message stream, which have a
// consumer per shard, take more consumers than nats-server's default
// limit per stream (1 000 since 2.12): a type of 1 024 shards had its
// replays refused while it was first allocated
// (integration.TestRebalanceAtHandoffSpeed). Where the account allows
// fewer, the streams are created under its limit, and opening them says
// so.
func TestConsumerRoom(t *testing.T) {
	const consumers = 1001 // one more than the server's default
	js := natstest.JetStream(t, natstest.Connect(t, natstest.URL(natstest.RunServer(t))))
	// 2 002 consumers: on a loaded machine (two fault tests and the
	// region's race tests beside it) they took longer than testCtx's
	// 30 s; the bound is against a hang, not a speed.
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	subjects := protocol.MustSubjects("", "", "many")
	var logs strings.Builder
	log := slog.New(slog.NewTextHandler(&logs, nil))
	if _, err := kvstate.OpenBuffer(ctx, js, subjects, kvstate.BufferOptions{Shards: consumers, Logger: log}); err != nil {
		t.Fatal(err)
	}
	if _, err := kvstate.OpenStream(ctx, js, subjects, kvstate.StreamOptions{Shards: consumers, MaxBytes: 1 << 20, Logger: log}); err != nil {
		t.Fatal(err)
	}
	for _, stream := range []string{kvstate.BufferStream("many"), kvstate.MessageStream("many")} {
		for i := range consumers {
			// A shard's, as a replay's or a region's would be (a work
			// queue takes one consumer per subject).
			cfg := jetstream.ConsumerConfig{Name: fmt.Sprintf("c%d", i), AckPolicy: jetstream.AckExplicitPolicy, FilterSubject: subjects.Shard(i), MemoryStorage: true}
			if stream == kvstate.BufferStream("many") {
				cfg.FilterSubject = subjects.Buffer(i)
			}
			if _, err := js.CreateConsumer(ctx, stream, cfg); err != nil {
				t.Fatalf("stream %s, consumer %d: %v", stream, i+1, err)
			}
		}
	}
	if strings.Contains(logs.String(), "may refuse consumers") {
		t.Errorf("a warning about consumers with room for them:\n%s", logs.String())
	}

	// An account that allows 10 consumers per stream.
	dir := t.TempDir()
	conf := filepath.Join(dir, "server.conf")
	if err := os.WriteFile(conf, fmt.Appendf(nil, `
listen: "127.0.0.1:-1"
jetstream { store_dir: %q }
accounts { A { jetstream { max_consumers: 10, max_file: 1G, max_mem: 64M }, users [{user: a, password: a}] } }
`, dir), 0o600); err != nil {
		t.Fatal(err)
	}
	opts, err := server.ProcessConfigFile(conf)
	if err != nil {
		t.Fatal(err)
	}
	opts.NoLog, opts.NoSigs = true, true
	limited := natstest.JetStream(t, natstest.Connect(t, natstest.URL(natstest.RunServerWithOptions(t, opts)), nats.UserInfo("a", "a")))
	logs.Reset()
	if _, err := kvstate.OpenBuffer(context.Background(), limited, subjects, kvstate.BufferOptions{Shards: 64, Logger: log}); err != nil {
		t.Fatalf("a buffer under an account's limit of consumers: %v", err)
	}
	if got := logs.String(); !strings.Contains(got, "may refuse consumers") || !strings.Contains(got, "max_consumers=10") {
		t.Errorf("no warning that the buffer has room for 10 consumers, 64 shards:\n%s", got)
	}
}
