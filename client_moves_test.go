package natshard_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

// TestClientRequestsOnceThroughMoves: natshard.Client's core requests
// carry no header; their reply subjects, marked unique, are their keys.
// While callers keep requesting, half the type's shards move back and
// forth between two nodes: every request is answered, and each is
// handled exactly once, in its caller's order. The copies that the
// moves made (a request sent while both nodes were subscribed reaches
// both) were skipped by those keys: without them they would be handled
// twice (TestHandoffUnderLoadWithoutMsgID in region counts such
// duplicates).
func TestClientRequestsOnceThroughMoves(t *testing.T) {
	const typ, shards = "logged", 4
	url := natstest.URL(natstest.RunServer(t))
	ctx := context.Background()
	log := &handledLog{seen: map[string][]string{}}
	entity := func(_ context.Context, id string) (natshard.Entity, error) { return &counter{id: id, log: log}, nil }
	nodes := map[string]*natshard.Node{}
	for _, region := range []string{"a", "b"} {
		// A grace long enough that requests are sent while both nodes
		// are subscribed to a moving shard.
		n, err := natshard.Start(ctx, natshard.Options{NATS: url, Region: region, ReleaseGrace: 500 * time.Millisecond, Logger: quiet},
			natshard.Type{Name: typ, Shards: shards, MinRegions: 2, RebalanceInterval: natshard.Off, Entity: entity})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = n.Close(ctx) })
		nodes[region] = n
	}
	held := func(region string) []int { s, _ := nodes[region].Stats(typ); return s.Shards }
	natstest.Eventually(t, 20*time.Second, "every shard held", func() bool { return len(held("a"))+len(held("b")) == shards })

	// 16 callers, each with entities of its own in every shard.
	client := natshard.NewClient(natstest.Connect(t, url))
	stop := make(chan struct{})
	var wg sync.WaitGroup
	sent := make([]map[string][]string, 16)
	for w := range sent {
		sent[w] = map[string][]string{}
		wg.Go(func() {
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				id := fmt.Sprintf("c%d-%d", w, n%8)
				body := strconv.Itoa(n)
				got, err := client.Request(ctx, typ, id, []byte(body))
				if err != nil || string(got) != body {
					t.Errorf("request %s to %s: %q, %v", body, id, got, err)
					return
				}
				sent[w][id] = append(sent[w][id], body)
			}
		})
	}

	// Shards 0 and 1 go to the other node, four times, one after the
	// other: the callers' requests to shards 2 and 3 go on meanwhile.
	admin := natstest.Connect(t, url)
	for move := range 4 {
		for _, shard := range []int{0, 1} {
			from, to := "a", "b"
			if slices.Contains(held("b"), shard) {
				from, to = "b", "a"
			}
			// Refused while the shard's last move is not recorded done.
			natstest.Eventually(t, 20*time.Second, fmt.Sprintf("move %d of shard %d taken", move, shard), func() bool {
				m, err := admin.Request(protocol.MustSubjects("", "", typ).Admin(protocol.AdminMove), fmt.Appendf(nil, `{"shard":%d,"region":%q}`, shard, to), 5*time.Second)
				if err != nil || !strings.Contains(string(m.Data), `"ok":true`) && !strings.Contains(string(m.Data), "is not active") {
					t.Fatalf("move %d of shard %d: %v %s", move, shard, err, m.Data)
				}
				return strings.Contains(string(m.Data), `"ok":true`)
			})
			natstest.Eventually(t, 20*time.Second, fmt.Sprintf("shard %d on %s alone", shard, to), func() bool {
				return slices.Contains(held(to), shard) && !slices.Contains(held(from), shard)
			})
		}
	}
	close(stop)
	wg.Wait()

	log.mu.Lock()
	defer log.mu.Unlock()
	requests := 0
	for _, byID := range sent {
		for id, bodies := range byID {
			requests += len(bodies)
			if got := log.seen[id]; !slices.Equal(got, bodies) {
				i := 0
				for i < min(len(got), len(bodies)) && got[i] == bodies[i] {
					i++
				}
				t.Errorf("entity %s handled %d requests, was sent %d; from request %d on it handled %q, was sent %q", id, len(got), len(bodies), i+1, got[i:min(i+5, len(got))], bodies[i:min(i+5, len(bodies))])
			}
		}
	}
	var skipped, replayed uint64
	for _, n := range nodes {
		s, _ := n.Stats(typ)
		skipped += s.DuplicatesSkipped
		replayed += s.Replayed
	}
	t.Logf("8 moves: %d requests, each handled once; %d replayed, %d copies skipped", requests, replayed, skipped)
	if skipped == 0 {
		t.Error("no copy of a request was skipped: the moves made none, and the test proved nothing")
	}
}
