package region_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/entities"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region"
)

const shards = 8

type fixture struct {
	nc       *nats.Conn
	store    *kvstate.Store
	buffer   *kvstate.Buffer
	subjects protocol.Subjects
	agent    *region.Agent
	inc      string
	handoff  uint64 // last handoff id used
	lease    kvstate.Lease
	epoch    uint64 // the test plays the coordinator of this epoch
}

// newEpoch makes the test the coordinator of a new epoch: it deposes the
// lease it holds, if any, and takes the lease again (regions check a new
// epoch against it). It returns the new lease.
func newEpoch(t *testing.T, store *kvstate.Store, held kvstate.Lease) kvstate.Lease {
	t.Helper()
	ctx := context.Background()
	if held.Revision != 0 {
		if err := store.DeposeCoordinator(ctx, held.Revision); err != nil {
			t.Fatal(err)
		}
	}
	l, err := store.AcquireCoordinator(ctx, protocol.CoordinatorInfo{Region: "test", Incarnation: fmt.Sprint(held.Revision)}, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func newFixture(t *testing.T) *fixture { return newFixtureWith(t, entities.Echo()) }

// answersFor reads n answers from sub, a refusal as "refused: <why>",
// and then checks for 200 ms that no other comes.
func answersFor(t *testing.T, sub *nats.Subscription, n int) []string {
	t.Helper()
	var got []string
	for len(got) < n {
		m, err := sub.NextMsg(5 * time.Second)
		if err != nil {
			t.Fatalf("after %d answers %v: %v", len(got), got, err)
		}
		if why := m.Header.Get(protocol.HeaderRefused); why != "" {
			got = append(got, "refused: "+why)
			continue
		}
		got = append(got, string(m.Data))
	}
	if m, err := sub.NextMsg(200 * time.Millisecond); err == nil {
		t.Fatalf("after %v, answered %q (headers %v)", got, m.Data, m.Header)
	}
	return got
}

// newFixtureWith is newFixture with the agent's entities made by factory.
func newFixtureWith(t *testing.T, factory region.Factory) *fixture {
	t.Helper()
	return newFixtureConfig(t, func(cfg *region.Config) { cfg.Factory = factory })
}

// newFixtureConfig is newFixture with the agent's configuration changed
// by mod.
func newFixtureConfig(t *testing.T, mod func(*region.Config)) *fixture {
	t.Helper()
	srv := natstest.RunServer(t)
	nc := natstest.Connect(t, natstest.URL(srv))
	js := natstest.JetStream(t, nc)
	store, err := kvstate.Open(context.Background(), js, "kv", kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	f := &fixture{nc: nc, store: store, subjects: protocol.MustSubjects("", "", "kv")}
	f.buffer, err = kvstate.OpenBuffer(context.Background(), js, f.subjects, kvstate.BufferOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cfg := region.Config{
		Conn: nc, Store: store, Buffer: f.buffer, Subjects: f.subjects, Shards: shards, ID: "r1", Factory: entities.Echo(),
		StallLimit: time.Minute, // the counts of suspensions below must not see a loaded machine's delays
	}
	mod(&cfg)
	f.agent, err = region.Open(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.agent.Close(context.Background()) })
	regions, err := store.Regions(context.Background())
	if err != nil || len(regions) != 1 {
		t.Fatalf("registration: %v %v", regions, err)
	}
	f.inc = regions[0].Info.Incarnation
	f.lease = newEpoch(t, store, kvstate.Lease{})
	f.epoch = f.lease.Revision
	return f
}

// command sends a raw command payload and decodes the reply.
func (f *fixture) command(t *testing.T, data []byte) protocol.Reply {
	t.Helper()
	m, err := f.nc.Request(f.subjects.Region("r1"), data, 2*time.Second)
	if err != nil {
		t.Fatalf("command: %v", err)
	}
	var r protocol.Reply
	if err := protocol.Decode(m.Data, &r); err != nil {
		t.Fatalf("reply: %v", err)
	}
	return r
}

func (f *fixture) send(t *testing.T, c protocol.Command) protocol.Reply {
	t.Helper()
	data, err := protocol.Encode(c)
	if err != nil {
		t.Fatal(err)
	}
	return f.command(t, data)
}

// bind binds the shards as a fresh allocation: a Bind with new handoff
// ids, whose end markers the test writes itself (as the parking
// coordinator would), so that the shards go live at once.
func (f *fixture) bind(t *testing.T, epoch uint64, shards ...int) protocol.Reply {
	t.Helper()
	ids := make([]uint64, len(shards))
	for i := range ids {
		f.handoff++
		ids[i] = f.handoff
	}
	r := f.send(t, protocol.Command{Kind: protocol.CmdBind, Epoch: epoch, Incarnation: f.inc, Shards: shards, Handoffs: ids})
	for i, s := range shards {
		if _, err := f.buffer.Mark(context.Background(), s, ids[i]); err != nil {
			t.Fatal(err)
		}
	}
	return r
}

func TestCommandsAndEpochs(t *testing.T) {
	f := newFixture(t)
	e1 := f.epoch
	r := f.bind(t, e1, 1, 3)
	if r.Error != "" || !slices.Equal(r.Held, []int{1, 3}) {
		t.Fatalf("bind: %+v", r)
	}
	// A stale epoch is refused and changes nothing.
	r = f.send(t, protocol.Command{Kind: protocol.CmdDrop, Epoch: e1 - 1, Incarnation: f.inc, Shards: []int{1}})
	if !strings.Contains(r.Error, fmt.Sprintf("stale epoch %d", e1-1)) || r.Epoch != e1 {
		t.Fatalf("stale drop: %+v", r)
	}
	// A newer epoch that is not the coordinator lease's (forged by a
	// holder of region credentials) is refused, and does not make the
	// real coordinator's commands stale.
	e2 := newEpoch(t, f.store, f.lease).Revision
	r = f.send(t, protocol.Command{Kind: protocol.CmdDrop, Epoch: e2 + 1000, Incarnation: f.inc, Shards: []int{1}})
	if !strings.Contains(r.Error, "not the coordinator lease's") || r.Epoch != e1 {
		t.Fatalf("forged newer epoch: %+v", r)
	}
	// A command for another incarnation is refused.
	r = f.send(t, protocol.Command{Kind: protocol.CmdDrop, Epoch: e2, Incarnation: "someone-else", Shards: []int{1}})
	if !strings.Contains(r.Error, "incarnation") || r.Incarnation != f.inc {
		t.Fatalf("wrong incarnation: %+v", r)
	}
	if got := f.agent.Held(); !slices.Equal(got, []int{1, 3}) {
		t.Fatalf("held %v after refused commands", got)
	}
	r = f.send(t, protocol.Command{Kind: protocol.CmdProbe, Epoch: e2, Incarnation: f.inc})
	if r.Error != "" || !slices.Equal(r.Held, []int{1, 3}) || r.Epoch != e2 {
		t.Fatalf("probe: %+v", r)
	}
	r = f.send(t, protocol.Command{Kind: protocol.CmdDrop, Epoch: e2, Incarnation: f.inc, Shards: []int{1}})
	if r.Error != "" || !slices.Equal(r.Held, []int{3}) {
		t.Fatalf("drop: %+v", r)
	}
	// A dropped shard is no longer subscribed: requests get no responders.
	if _, err := f.nc.Request(f.subjects.EntityOf(idIn(1), shards), []byte("x"), time.Second); err != nats.ErrNoResponders {
		t.Fatalf("request to dropped shard: %v", err)
	}
	if m, err := f.nc.Request(f.subjects.EntityOf(idIn(3), shards), []byte("hello"), time.Second); err != nil || string(m.Data) != "hello" {
		t.Fatalf("request to bound shard: %v", err)
	}
}

func TestGarbageCommandsAreRefused(t *testing.T) {
	f := newFixture(t)
	for _, data := range [][]byte{
		nil,
		[]byte("garbage"),
		[]byte{0xc1},
		mustEncode(t, protocol.Command{Kind: 99, Epoch: 1, Incarnation: f.inc}),
		mustEncode(t, protocol.Command{Kind: protocol.CmdBind, Epoch: 0, Incarnation: f.inc}),
		mustEncode(t, protocol.Command{Kind: protocol.CmdBind, Epoch: 1, Incarnation: f.inc, Shards: []int{shards}}),
		mustEncode(t, protocol.Command{Kind: protocol.CmdBind, Epoch: 1, Incarnation: f.inc, Shards: []int{-1}}),
		mustEncode(t, map[string]any{"k": "bind", "e": "soon"}),
	} {
		if r := f.command(t, data); r.Error == "" {
			t.Errorf("%q was accepted: %+v", data, r)
		}
	}
	if got := f.agent.Stats().Refused.Load(); got != 8 {
		t.Errorf("refused counter %d, want 8", got)
	}
	if held := f.agent.Held(); len(held) != 0 {
		t.Fatalf("garbage bound shards: %v", held)
	}
}

func TestMalformedDataMessages(t *testing.T) {
	f := newFixture(t)
	f.bind(t, f.epoch, 0, 1, 2, 3, 4, 5, 6, 7)
	id := idIn(2)
	wrong := (protocol.ShardOf(id, shards) + 1) % shards
	for _, subject := range []string{
		f.subjects.Entity(wrong, id),             // id belongs to another shard
		f.subjects.Entity(2, "a*b"),              // a wildcard character inside a token
		"shard.kv.2." + strings.Repeat("x", 300), // too long
	} {
		m, err := f.nc.Request(subject, []byte("x"), 2*time.Second)
		if err != nil {
			t.Fatalf("%s: no answer: %v", subject, err)
		}
		if m.Header.Get(protocol.HeaderError) == "" || !strings.Contains(string(m.Data), `"ok":false`) {
			t.Fatalf("%s: answer without error: %q %v", subject, m.Data, m.Header)
		}
		if got := m.Header.Get(protocol.HeaderRefused); got != protocol.RefusedMalformed {
			t.Fatalf("%s: refused %q, want %q", subject, got, protocol.RefusedMalformed)
		}
	}
	if got := f.agent.Stats().Malformed.Load(); got != 3 {
		t.Fatalf("malformed counter %d, want 3", got)
	}
	// Plain publishes of malformed subjects are dropped and counted too,
	// and the region keeps serving. The probe goes to an entity of the
	// malformed subject's own shard: each shard's subject has its own
	// subscription, and only one subscription's callbacks run in the order
	// the messages were published (the malformed one is counted before
	// the probe is answered).
	if err := f.nc.Publish(f.subjects.Entity(wrong, id), []byte("x")); err != nil {
		t.Fatal(err)
	}
	if m, err := f.nc.Request(f.subjects.EntityOf(idIn(wrong), shards), []byte("still here"), 2*time.Second); err != nil || string(m.Data) != "still here" {
		t.Fatalf("after bad input: %v", err)
	}
	if got := f.agent.Stats().Malformed.Load(); got != 4 {
		t.Fatalf("malformed counter %d, want 4", got)
	}
}

// TestRemovedRegistrationFences: when the coordinator removes a region's
// registration (it found the region dead), a region that still runs stops
// serving everything and registers again as a new incarnation.
func TestRemovedRegistrationFences(t *testing.T) {
	f := newFixture(t)
	f.bind(t, f.epoch, 0, 1)
	regions, err := f.store.Regions(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := f.store.RemoveRegion(context.Background(), "r1", regions[0].Revision); err != nil {
		// The region may have renewed in between; take the fresh revision.
		regions, _ = f.store.Regions(context.Background())
		if err := f.store.RemoveRegion(context.Background(), "r1", regions[0].Revision); err != nil {
			t.Fatal(err)
		}
	}
	natstest.Eventually(t, 10*time.Second, "fenced and registered again", func() error {
		regions, _ := f.store.Regions(context.Background())
		if len(f.agent.Held()) == 0 && len(regions) == 1 && regions[0].Info.Incarnation != f.inc {
			return nil
		}
		return fmt.Errorf("held %v, regions %+v", f.agent.Held(), regions)
	})
}

func idIn(shard int) string {
	for i := 0; ; i++ {
		if id := fmt.Sprintf("id-%d", i); protocol.ShardOf(id, shards) == shard {
			return id
		}
	}
}

func mustEncode(t *testing.T, v any) []byte {
	t.Helper()
	data, err := protocol.Encode(v)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// TestRefusedReasons: a request that no entity handled says so, with the
// reason, and a message that an entity failed does not.
func TestRefusedReasons(t *testing.T) {
	f := newFixtureWith(t, func(context.Context, string) (region.Entity, error) { return failing{}, nil })
	f.bind(t, f.epoch, 1)
	m, err := f.nc.Request(f.subjects.EntityOf(idIn(1), shards), []byte("x"), 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if m.Header.Get(protocol.HeaderError) != "no such thing" || m.Header.Get(protocol.HeaderRefused) != "" {
		t.Fatalf("entity error answered with headers %v", m.Header)
	}
	// A message held while its shard replays, then dropped with the
	// shard, is not answered: the coordinator drops a shard it gives
	// elsewhere, and the next owner answers its own copy.
	r := f.send(t, protocol.Command{Kind: protocol.CmdBind, Epoch: f.epoch, Incarnation: f.inc, Shards: []int{3}, Handoffs: []uint64{999}})
	if r.Error != "" {
		t.Fatalf("bind: %+v", r)
	}
	// No end marker 999: shard 3 replays and holds what arrives.
	inbox := nats.NewInbox()
	sub, err := f.nc.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	held := f.agent.Stats().Held.Load() // shard 1's request may have been held a moment
	if err := f.nc.PublishRequest(f.subjects.EntityOf(idIn(3), shards), inbox, []byte("held")); err != nil {
		t.Fatal(err)
	}
	natstest.Eventually(t, 5*time.Second, "the message to the replaying shard held", func() bool { return f.agent.Stats().Held.Load() != held })
	if r := f.send(t, protocol.Command{Kind: protocol.CmdDrop, Epoch: f.epoch, Incarnation: f.inc, Shards: []int{3}}); r.Error != "" {
		t.Fatalf("drop: %+v", r)
	}
	natstest.Eventually(t, 5*time.Second, "the held message dropped", func() bool { return f.agent.Stats().NotOwned.Load() == 1 })
	if got := answersFor(t, sub, 0); len(got) != 0 {
		t.Fatalf("held message of a dropped shard answered %v", got)
	}
}

type failing struct{}

func (failing) Handle(context.Context, *region.Message) ([]byte, error) {
	return nil, errors.New("no such thing")
}
func (failing) Stop(context.Context) error { return nil }

// TestOpenRefusesBadConfig: Open refuses a configuration it cannot
// serve, before it registers anything.
func TestOpenRefusesBadConfig(t *testing.T) {
	f := newFixture(t)
	base := region.Config{Conn: f.nc, Store: f.store, Buffer: f.buffer, Subjects: f.subjects, Shards: shards, ID: "r2", Factory: entities.Echo()}
	for name, mod := range map[string]func(*region.Config){
		"no shards":       func(c *region.Config) { c.Shards = 0 },
		"too many shards": func(c *region.Config) { c.Shards = protocol.MaxShards + 1 },
		"no factory":      func(c *region.Config) { c.Factory = nil },
		"bad id":          func(c *region.Config) { c.ID = "a b" },
	} {
		cfg := base
		mod(&cfg)
		if a, err := region.Open(context.Background(), cfg); err == nil {
			a.Close(context.Background())
			t.Errorf("%s: Open accepted it", name)
		}
	}
	if regions, err := f.store.Regions(context.Background()); err != nil || len(regions) != 1 {
		t.Fatalf("regions %v, %v: want only the fixture's", regions, err)
	}
}

// TestRegionIDInUse: a second process with the id of a live region
// refuses to start; once that region's process is gone (its connection
// closed, as after kill -9: its registration stays until its TTL), a new
// one takes the id over at once.
func TestRegionIDInUse(t *testing.T) {
	f := newFixture(t)
	open := func(nc *nats.Conn) (*region.Agent, error) {
		js := natstest.JetStream(t, nc)
		store, err := kvstate.Open(context.Background(), js, "kv", kvstate.Options{})
		if err != nil {
			t.Fatal(err)
		}
		return region.Open(context.Background(), region.Config{
			Conn: nc, Store: store, Buffer: f.buffer, Subjects: f.subjects, Shards: shards, ID: "r1", Factory: entities.Echo(),
		})
	}
	other := natstest.Connect(t, f.nc.ConnectedUrl())
	if a, err := open(other); !errors.Is(err, region.ErrRegionInUse) {
		if a != nil {
			a.Close(context.Background())
		}
		t.Fatalf("second region r1: %v, want ErrRegionInUse", err)
	}
	f.nc.Close() // the first process dies
	a, err := open(other)
	if err != nil {
		t.Fatalf("region r1 after its process died: %v", err)
	}
	a.Close(context.Background())
}

// TestRegionIDTakenOver: when another live process registers under a
// running region's id (both started at once), the region that lost the
// registration stops for good (Done, ErrRegionInUse) instead of taking
// it back, which would fence the other, and so on for ever.
func TestRegionIDTakenOver(t *testing.T) {
	f := newFixture(t)
	f.bind(t, f.epoch, 0, 1)
	// The other process: answers r1's queries as another instance, and
	// registers r1.
	other := natstest.Connect(t, f.nc.ConnectedUrl())
	if _, err := other.Subscribe(f.subjects.Query("r1"), func(m *nats.Msg) {
		_ = m.Respond([]byte(`{"region":"r1","incarnation":"theirs","instance":"other-process","shards":[]}`))
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := f.store.RegisterRegion(context.Background(), protocol.RegionInfo{ID: "r1", Incarnation: "theirs", Instance: "other-process"}, time.Minute); err != nil {
		t.Fatal(err)
	}
	select {
	case <-f.agent.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the region that lost its id's registration to a live process did not stop")
	}
	if err := f.agent.Err(); !errors.Is(err, region.ErrRegionInUse) {
		t.Fatalf("Err() = %v, want ErrRegionInUse", err)
	}
	if held := f.agent.Held(); len(held) != 0 {
		t.Fatalf("stopped region holds %v", held)
	}
	info, _, err := f.store.Region(context.Background(), "r1")
	if err != nil || info.Incarnation != "theirs" {
		t.Fatalf("registration %+v, %v: the stopped region took it back", info, err)
	}
}

// TestSuspendedHoldsAtMostMaxHeld: a suspended shard holds at most
// MaxHeld arrivals; the next are dropped, counted and not answered (the
// shard may have been given away meanwhile, and its next holder answer
// its own copy: a refusal would be false); back on NATS the shard
// delivers what it held, in order, and nothing else is answered.
func TestSuspendedHoldsAtMostMaxHeld(t *testing.T) {
	const maxHeld, sent = 5, 8
	f := newFixtureConfig(t, func(cfg *region.Config) { cfg.MaxHeld = maxHeld })
	ctx := context.Background()
	f.bind(t, f.epoch, 0)
	natstest.Eventually(t, 30*time.Second, "shard 0 live", func() bool { return f.agent.Status().Live == 1 })
	if _, err := f.store.PutShard(ctx, f.lease, protocol.ShardRecord{Shard: 0, Region: "r1", Incarnation: f.inc, State: protocol.StateActive, Epoch: f.epoch}); err != nil {
		t.Fatal(err)
	}
	answers, err := f.nc.SubscribeSync(nats.NewInbox())
	if err != nil {
		t.Fatal(err)
	}
	f.agent.Suspend("test")
	natstest.Eventually(t, 30*time.Second, "shard 0 suspended", func() bool { return f.agent.Status().Suspended == 1 })
	for i := range sent {
		m := nats.NewMsg(f.subjects.EntityOf(idIn(0), shards))
		m.Reply, m.Data = answers.Subject, fmt.Appendf(nil, "%d", i)
		if err := f.nc.PublishMsg(m); err != nil {
			t.Fatal(err)
		}
	}
	natstest.Eventually(t, 30*time.Second, "the arrivals beyond MaxHeld counted", func() bool { return f.agent.Stats().HeldOverflow.Load() == sent-maxHeld })
	f.agent.Reconnected()
	for i := range maxHeld {
		m, err := answers.NextMsg(5 * time.Second)
		if err != nil {
			t.Fatalf("held message %d: %v", i, err)
		}
		if want := strconv.Itoa(i); string(m.Data) != want || m.Header.Get(protocol.HeaderRefused) != "" {
			t.Fatalf("held message %d answered %q (headers %v), want %q", i, m.Data, m.Header, want)
		}
	}
	if m, err := answers.NextMsg(200 * time.Millisecond); err == nil {
		t.Fatalf("a message beyond MaxHeld was answered %q (headers %v)", m.Data, m.Header)
	}
}

// TestSuspendAndConfirm (issue 17, ride-through of a NATS server loss):
// a suspended region holds what arrives for its live shards; back on
// NATS, it renews its registration and reads the shard table, resumes
// the shards the table still gives it (delivering what it held, in
// order) and drops the others (what they held is dropped unanswered:
// their next holder has its own copy). If the coordinator removed its
// registration meanwhile, it fences instead.
func TestSuspendAndConfirm(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	f.bind(t, f.epoch, 0, 1)
	natstest.Eventually(t, 30*time.Second, "shards 0 and 1 live", func() bool { return f.agent.Status().Live == 2 })
	for _, row := range []protocol.ShardRecord{
		{Shard: 0, Region: "r1", Incarnation: f.inc, State: protocol.StateActive, Epoch: f.epoch},
		{Shard: 1, Region: "r2", Incarnation: "other", State: protocol.StateBinding, Epoch: f.epoch}, // given away meanwhile
	} {
		if _, err := f.store.PutShard(ctx, f.lease, row); err != nil {
			t.Fatal(err)
		}
	}
	answers, err := f.nc.SubscribeSync(nats.NewInbox())
	if err != nil {
		t.Fatal(err)
	}
	f.agent.Suspend("test")
	natstest.Eventually(t, 30*time.Second, "shards 0 and 1 suspended", func() bool { return f.agent.Status().Suspended == 2 })
	held := f.agent.Stats().Held.Load()
	const n = 20
	for i := range n {
		for _, shard := range []int{0, 1} {
			m := nats.NewMsg(f.subjects.EntityOf(idIn(shard), shards))
			m.Reply, m.Data = answers.Subject, fmt.Appendf(nil, "%d-%d", shard, i)
			if err := f.nc.PublishMsg(m); err != nil {
				t.Fatal(err)
			}
		}
	}
	natstest.Eventually(t, 30*time.Second, "the arrivals held", func() bool { return f.agent.Stats().Held.Load() == held+2*n })
	if m, err := answers.NextMsg(50 * time.Millisecond); err == nil {
		t.Fatalf("a suspended shard answered %q", m.Data)
	}

	f.agent.Reconnected()
	// Shard 1's 20 are r2's to answer (it holds its own copies since its
	// bind): a refusal here would say that nothing was done with them.
	got := answersFor(t, answers, n)
	want := make([]string, n)
	for i := range want {
		want[i] = fmt.Sprintf("0-%d", i)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("answered %v; want %v and nothing of shard 1", got, want)
	}
	if d := f.agent.Stats().NotOwned.Load(); d != n {
		t.Fatalf("NotOwned = %d, want %d", d, n)
	}
	if h := f.agent.Held(); !slices.Equal(h, []int{0}) || f.agent.Stats().Confirmed.Load() != 1 || f.agent.Stats().Fenced.Load() != 0 {
		t.Fatalf("held %v, confirmed %d, fenced %d", h, f.agent.Stats().Confirmed.Load(), f.agent.Stats().Fenced.Load())
	}

	// Suspended again, and the coordinator removes the registration
	// meanwhile: the renewal fails, the region fences and registers anew.
	f.agent.Suspend("test")
	regions, err := f.store.Regions(ctx)
	if err != nil || len(regions) != 1 {
		t.Fatalf("regions %v: %v", regions, err)
	}
	if err := f.store.RemoveRegion(ctx, "r1", regions[0].Revision); err != nil {
		t.Fatal(err)
	}
	f.agent.Reconnected()
	natstest.Eventually(t, 30*time.Second, "the fence", func() bool { return f.agent.Stats().Fenced.Load() == 1 && len(f.agent.Held()) == 0 })
	if c := f.agent.Stats().Confirmed.Load(); c != 1 {
		t.Fatalf("confirmed %d times, want 1", c)
	}
}

// TestReplaysBounded: a region given many shards at once (a type's first
// allocation) reads at most 64 of their buffers at once (maxReplays), each
// with a consumer on the buffer stream; the others wait, and every shard
// goes live once its end marker is written. A region given 1 024 shards
// started 1 024 replays, and JetStream, under that load, could no longer
// renew the leases in time (integration.TestRebalanceAtHandoffSpeed).
func TestReplaysBounded(t *testing.T) {
	const n, most = 200, 64
	f := newFixtureConfig(t, func(cfg *region.Config) { cfg.Shards = n })
	all := make([]int, n)
	ids := make([]uint64, n)
	for i := range all {
		all[i] = i
		f.handoff++
		ids[i] = f.handoff
	}
	// Bound, their markers not written yet: their replays wait.
	if r := f.send(t, protocol.Command{Kind: protocol.CmdBind, Epoch: f.epoch, Incarnation: f.inc, Shards: all, Handoffs: ids}); r.Error != "" || len(r.Held) != n {
		t.Fatalf("bind: %+v", r)
	}
	stream, err := natstest.JetStream(t, f.nc).Stream(context.Background(), kvstate.BufferStream("kv"))
	if err != nil {
		t.Fatal(err)
	}
	consumers := func() int {
		info, err := stream.Info(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return info.State.Consumers
	}
	natstest.Eventually(t, 30*time.Second, fmt.Sprintf("%d replays reading", most), func() bool { return consumers() >= most })
	for range 10 {
		if c := consumers(); c > most {
			t.Fatalf("%d consumers on the buffer: more replays than %d at once", c, most)
		}
		time.Sleep(50 * time.Millisecond)
	}
	for i, s := range all {
		if _, err := f.buffer.Mark(context.Background(), s, ids[i]); err != nil {
			t.Fatal(err)
		}
	}
	natstest.Eventually(t, 30*time.Second, "every shard live", func() bool { return f.agent.Status().Live == n })
}
