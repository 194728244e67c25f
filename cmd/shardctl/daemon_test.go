package main

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/entities"
	"github.com/natshard/natshard/internal/natstest"
)

// TestDaemonTranscript: shardctl daemon shows a daemon's workers (where
// each runs, a worker that returned an error and was started again), and
// scale changes their count; checked against testdata/daemon.golden and
// scale.golden.
func TestDaemonTranscript(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	var failed atomic.Bool
	run := func(ctx context.Context, index int) error {
		if index == 1 && failed.CompareAndSwap(false, true) {
			return errors.New("the feed was not there yet")
		}
		<-ctx.Done()
		return nil
	}
	d := natshard.Daemon{Name: "feeds", Workers: 3, Run: run}.Type()
	d.Shards = 8
	n, err := natshard.Start(context.Background(), natshard.Options{Conn: natstest.Connect(t, url), Region: "a", Logger: slog.New(slog.DiscardHandler)},
		d, natshard.Type{Name: "kv", Entity: entities.KV(nil), Shards: 8})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	tr := &transcript{t: t, url: url, golden: map[string]*bytes.Buffer{}}
	defer tr.check()

	// Until every worker runs, worker 1 after its restart.
	waitWorkers := func(want string) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for {
			out, _, err := ctl(t, url, "--type", "feeds", "daemon")
			if err == nil && out == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("the workers never came to:\n%s\nlast:\n%s %v", want, out, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	waitWorkers(`3 workers
WORKER  SHARD  REGION  RUNNING  RESTARTS  LAST ERROR
0       0      a       yes      0         -
1       1      a       yes      1         the feed was not there yet
2       2      a       yes      0         -
`)
	tr.record2("daemon", "--type", "feeds", "daemon")
	tr.record2("daemon", "--type", "feeds", "daemon", "--json")
	tr.record2("scale", "--type", "feeds", "scale", "5")
	waitWorkers(`5 workers
WORKER  SHARD  REGION  RUNNING  RESTARTS  LAST ERROR
0       0      a       yes      0         -
1       1      a       yes      1         the feed was not there yet
2       2      a       yes      0         -
3       3      a       yes      0         -
4       4      a       yes      0         -
`)
	tr.record2("scale", "--type", "feeds", "scale", "0", "--json")
	tr.record2("daemon", "--type", "feeds", "daemon")
	for _, args := range [][]string{
		{"--type", "feeds", "scale", "many"},
		{"--type", "feeds", "scale", "-1"},
		{"--type", "kv", "scale", "2"},
	} {
		tr.record2("scale", args...)
	}
	tr.record2("daemon", "--type", "kv", "daemon")
}

// record2 runs shardctl with args and records it in testdata/<name>.golden
// (record names the file after the first argument, here a flag).
func (tr *transcript) record2(name string, args ...string) {
	tr.t.Helper()
	out, _, err := ctl(tr.t, tr.url, args...)
	tr.recordAs(name, args, out, err)
}
