package region_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region"
)

// instances is an entity factory that logs what each entity handles, per
// publisher, and reports an entity that has two incarnations at once in
// the whole cluster (a split restarts an entity in its child: its old
// incarnation must have stopped first).
type instances struct {
	mu         sync.Mutex
	live       map[string]int                 // entity id -> incarnations not stopped
	got        map[string]map[string][]string // entity id -> publisher -> sequence numbers handled, in order
	violations []string
	handled    atomic.Int64
}

func newInstances() *instances {
	return &instances{live: map[string]int{}, got: map[string]map[string][]string{}}
}

func (in *instances) factory(_ context.Context, id string) (region.Entity, error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.live[id]++; in.live[id] > 1 {
		in.violations = append(in.violations, fmt.Sprintf("entity %s has %d incarnations at once", id, in.live[id]))
	}
	return &instanceEntity{in: in, id: id}, nil
}

type instanceEntity struct {
	in *instances
	id string
}

// Handle takes payloads "<publisher> <seq>".
func (e *instanceEntity) Handle(_ context.Context, m *region.Message) ([]byte, error) {
	pub, seq, _ := strings.Cut(string(m.Data), " ")
	e.in.mu.Lock()
	if e.in.got[e.id] == nil {
		e.in.got[e.id] = map[string][]string{}
	}
	e.in.got[e.id][pub] = append(e.in.got[e.id][pub], seq)
	e.in.mu.Unlock()
	e.in.handled.Add(1)
	return nil, nil
}

func (e *instanceEntity) Stop(context.Context) error {
	e.in.mu.Lock()
	e.in.live[e.id]--
	e.in.mu.Unlock()
	return nil
}

// splitPublisher sends "<name> <seq>" to its entities round robin, keyed
// (Nats-Msg-Id), computing shards with count, which it reads before every
// message (a publisher that switches to a type's new count).
type splitPublisher struct {
	name  string
	ids   []string
	count atomic.Int64
	sent  map[string]int
	stop  chan struct{}
	done  chan struct{}
}

func (p *splitPublisher) run(t *testing.T, nc *nats.Conn, subjects protocol.Subjects, handled *atomic.Int64) {
	defer close(p.done)
	var published int64
	for i := 0; ; i++ {
		select {
		case <-p.stop:
			if err := nc.Flush(); err != nil {
				t.Error(err)
			}
			return
		default:
		}
		for published-handled.Load() > 2000 { // stay within what the entities take
			time.Sleep(100 * time.Microsecond)
		}
		if i%10 == 0 {
			// At most about 2 000 a second: a shard that moves diverts its
			// messages to JetStream meanwhile, which a loaded machine
			// writes slowly.
			time.Sleep(5 * time.Millisecond)
		}
		id := p.ids[i%len(p.ids)]
		p.sent[id]++
		m := nats.NewMsg(subjects.EntityOf(id, int(p.count.Load())))
		m.Data = fmt.Appendf(nil, "%s %d", p.name, p.sent[id])
		m.Header.Set(protocol.HeaderMsgID, fmt.Sprintf("%s/%s/%d", p.name, id, p.sent[id]))
		if err := nc.PublishMsg(m); err != nil {
			t.Error(err)
			return
		}
		published++
	}
}

// TestSplitUnderLoad: two regions hold a type of 4 shards while two
// publishers send to 64 entities; the type splits to 8 (each region splits
// the shards it holds: the children listen on their parents' subjects),
// one publisher switches to the new count at once and the other keeps the
// old one, then a child moves to the other region, its old subject's
// messages following it through the handoff. Every entity handles every
// message of each publisher once and in order, never with two
// incarnations at once.
func TestSplitUnderLoad(t *testing.T) {
	c := newCluster(t, kvstate.BufferOptions{})
	ctx := context.Background()
	if _, err := c.store.EnsureConfig(ctx, protocol.TypeConfig{Shards: 4}); err != nil {
		t.Fatal(err)
	}
	in := newInstances()
	four := func(cfg *region.Config) {
		cfg.Shards, cfg.Factory = 4, in.factory
		// A loaded machine's JetStream may take seconds to renew a
		// registration: the default 4 s lease fenced both regions once.
		cfg.LeaseTTL = 30 * time.Second
		if testing.Verbose() {
			cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, nil))
		}
	}
	a := c.addAgent("a", four)
	b := c.addAgent("b", four)
	c.allocate("a", 0, 1)
	c.allocate("b", 2, 3)

	var ids []string
	for i := range 64 {
		ids = append(ids, fmt.Sprintf("e-%d", i))
	}
	var pubs []*splitPublisher
	for _, name := range []string{"switches", "keeps"} {
		p := &splitPublisher{name: name, ids: ids, sent: map[string]int{}, stop: make(chan struct{}), done: make(chan struct{})}
		p.count.Store(4)
		pubs = append(pubs, p)
		go p.run(t, natstest.Connect(t, c.url), c.subjects, &in.handled)
	}
	natstest.Eventually(t, 30*time.Second, "some traffic", func() bool { return in.handled.Load() > 2000 })

	// The split: the commit, then the command to every region.
	if _, err := c.store.PutConfig(ctx, c.lease, protocol.TypeConfig{Shards: 4, To: 8}); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"a", "b"} {
		natstest.Eventually(t, 30*time.Second, "region "+id+" to split", func() bool {
			r := c.must(id, protocol.Command{Kind: protocol.CmdSplit, Count: 8})
			return len(r.Replaying) == 0
		})
	}
	if held := a.Held(); !slices.Equal(held, []int{0, 1, 4, 5}) {
		t.Fatalf("a holds %v after the split, want [0 1 4 5]", held)
	}
	if got := a.Layout().String(); got != "4>8" {
		t.Fatalf("a routes by %s", got)
	}
	if _, err := c.store.PutConfig(ctx, c.lease, protocol.TypeConfig{Shards: 8, History: []int{4}}); err != nil {
		t.Fatal(err)
	}
	pubs[0].count.Store(8) // the announce: the Client switches
	before := in.handled.Load()
	natstest.Eventually(t, 30*time.Second, "more traffic", func() bool { return in.handled.Load() > before+2000 })
	// A child moves: the old subject's messages for it follow it.
	c.move([]int{5}, "a", "b")
	before = in.handled.Load()
	natstest.Eventually(t, 30*time.Second, "more traffic after the move", func() bool { return in.handled.Load() > before+2000 })

	for _, p := range pubs {
		close(p.stop)
		<-p.done
	}
	natstest.Eventually(t, 30*time.Second, "every message handled", func() bool {
		in.mu.Lock()
		defer in.mu.Unlock()
		for _, p := range pubs {
			for id, n := range p.sent {
				if len(in.got[id][p.name]) < n {
					return false
				}
			}
		}
		return true
	})
	in.mu.Lock()
	defer in.mu.Unlock()
	for _, v := range in.violations {
		t.Error(v)
	}
	for _, p := range pubs {
		for id, n := range p.sent {
			got := in.got[id][p.name]
			for i, s := range got {
				if s != strconv.Itoa(i+1) {
					t.Fatalf("entity %s, publisher %s: handled %v... in place %d, want 1..%d once each, in order", id, p.name, got[max(0, i-3):min(len(got), i+3)], i, n)
				}
			}
			if len(got) != n {
				t.Fatalf("entity %s, publisher %s: %d handled, %d sent", id, p.name, len(got), n)
			}
		}
	}
	old := a.Stats().OldSubject.Load() + b.Stats().OldSubject.Load()
	if old == 0 || b.Stats().OldSubject.Load() == 0 {
		t.Fatalf("old-subject messages: a %d, b %d; the publisher that kept the old count sends some to every child", a.Stats().OldSubject.Load(), b.Stats().OldSubject.Load())
	}
	t.Logf("handled %d; old-subject messages %d; b holds %v", in.handled.Load(), old, b.Held())
}
