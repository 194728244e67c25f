package protocol_test

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

// TestShardOfMatchesServerPartition checks protocol.ShardOf against the
// NATS server's own partition() subject mapping function: a server whose
// account maps part.<id> to mapped.<partition(128) of id>.<id> must put
// every id in the shard ShardOf computes.
func TestShardOfMatchesServerPartition(t *testing.T) {
	const (
		shards = protocol.DefaultShards
		count  = 10_000
	)
	srv := natstest.RunServer(t)
	if err := srv.GlobalAccount().AddMapping("part.*", fmt.Sprintf("mapped.{{partition(%d,1)}}.{{wildcard(1)}}", shards)); err != nil {
		t.Fatal(err)
	}
	nc := natstest.Connect(t, natstest.URL(srv))
	ch := make(chan string, count)
	sub, err := nc.Subscribe("mapped.>", func(m *nats.Msg) { ch <- m.Subject })
	if err != nil {
		t.Fatal(err)
	}
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		t.Fatal(err)
	}

	// partition(n,1) hashes the first wildcard token only, so the ids are
	// single tokens: mostly plain, some with characters that are legal in a
	// subject token but unusual.
	odd := []string{"ü", "日本", "a=b", "x:y", "$", "#", "%", "~", "-", "_", "/", "\\", "@", "é+è", "\u00a0"}
	ids := make(map[string]bool, count)
	for i := range count {
		id := fmt.Sprintf("id-%d", i)
		if i%7 == 0 {
			id = fmt.Sprintf("%s%d%s", odd[i%len(odd)], i, odd[(i/7)%len(odd)])
		}
		if err := protocol.ValidateEntityID(id); err != nil || strings.Contains(id, ".") {
			t.Fatalf("test id %q is not a single-token entity id: %v", id, err)
		}
		ids[id] = true
		if err := nc.Publish("part."+id, nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}

	perShard := make([]int, shards)
	timeout := time.After(10 * time.Second)
	for n := 0; n < count; n++ {
		var subj string
		select {
		case subj = <-ch:
		case <-timeout:
			t.Fatalf("received %d of %d mapped messages", n, count)
		}
		tok := strings.SplitN(subj, ".", 3)
		if len(tok) != 3 || tok[0] != "mapped" {
			t.Fatalf("unexpected subject %q", subj)
		}
		shard, err := strconv.Atoi(tok[1])
		if err != nil {
			t.Fatalf("subject %q: shard token: %v", subj, err)
		}
		id := tok[2]
		if !ids[id] {
			t.Fatalf("subject %q: unknown or repeated id %q", subj, id)
		}
		delete(ids, id)
		if want := protocol.ShardOf(id, shards); shard != want {
			t.Errorf("id %q: server partition %d, ShardOf %d", id, shard, want)
		}
		perShard[shard]++
	}
	for s, n := range perShard {
		if n == 0 {
			t.Errorf("shard %d received no id of %d", s, count)
		}
	}
}
