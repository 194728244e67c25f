package coordinator

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/region"
)

// TestLongBatchRenewsTheLease: the leader carries out its table writes,
// in batches of at most kvstate.MaxShardBatch rows, in the loop that
// renews its lease, so a long run of them (a first allocation of many
// shards: 3 writes each) could outlast the lease; its writes would then
// be refused as fenced and the next term would start over. A batch whose
// renewal is due renews first. The test makes the renewal due without
// waiting: the last renewal is said to have been sent 300 ms ago (a
// 1 s lease is renewed every 250 ms).
func TestLongBatchRenewsTheLease(t *testing.T) {
	nc := natstest.Connect(t, natstest.URL(natstest.RunServer(t)))
	store, err := kvstate.Open(context.Background(), natstest.JetStream(t, nc), "kv", kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	info := protocol.CoordinatorInfo{Region: "c1", Incarnation: "c1-1"}
	lease, err := store.AcquireCoordinator(ctx, info, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	n := New(Config{Conn: nc, Store: store, Subjects: protocol.MustSubjects("", "", "kv"), Shards: 4, LeaseTTL: time.Second})
	l := &leader{Node: n, info: info, lease: lease, renewedAt: time.Now().Add(-300 * time.Millisecond)}
	l.core, _ = NewCore(CoreConfig{Shards: 4}, "c1", lease.Revision, nil, nil)
	l.track = newMoveTracker(n.cfg.Stats, nil, 4, nil)
	defer l.track.stop()

	before := l.renewedAt
	rec := protocol.ShardRecord{Shard: 0, State: protocol.StateParked, Epoch: lease.Revision, Handoff: 1}
	if err := l.execute(ctx, []Action{WriteShard{Record: rec}}); err != nil {
		t.Fatal(err)
	}
	if !l.renewedAt.After(before) || l.lease.Revision == lease.Revision {
		t.Fatalf("a table write with the renewal due did not renew the lease (revision %d, still %d)", lease.Revision, l.lease.Revision)
	}
	// The write went out under the renewed lease.
	table, err := store.Shards(ctx)
	if err != nil || len(table) != 1 || table[0].State != protocol.StateParked {
		t.Fatalf("table %+v, %v", table, err)
	}
}

// TestRowsRenewTheLease: rows written one after another (fewer than a
// batch pays for, or a batch the server refused) are a round trip each,
// a quarter of a second under load: the renewal, when due, goes between
// two of them, not only before the first. The test's clock, which only
// renewIfDue reads, jumps 600 ms ahead at its second reading (a 2 s lease
// is renewed every 500 ms): at the second row; where a batch was tried
// first, at the first row after the server refused it. Before, 22 rows
// were written with no renewal between them, and under load the server
// expired the lease halfway; rows of a refused batch went one at a time
// inside kvstate, out of the leader's reach.
func TestRowsRenewTheLease(t *testing.T) {
	for _, tc := range []struct {
		name     string
		rows     int
		maxBatch int // the server's max_batch_size; 0: its default
	}{
		{"rows alone", 22, 0},
		{"batch refused", 101, 100},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := natstest.DefaultOptions(t)
			opts.JetStreamLimits.MaxBatchSize = tc.maxBatch
			nc := natstest.Connect(t, natstest.URL(natstest.RunServerWithOptions(t, opts)))
			store, err := kvstate.Open(context.Background(), natstest.JetStream(t, nc), "kv", kvstate.Options{})
			if err != nil {
				t.Fatal(err)
			}
			if batch := tc.maxBatch > 0; store.Batches(tc.rows) != batch {
				t.Fatalf("Batches(%d) = %v; the test needs %v", tc.rows, !batch, batch)
			}
			ctx := context.Background()
			info := protocol.CoordinatorInfo{Region: "c1", Incarnation: "c1-1"}
			const ttl = 2 * time.Second
			lease, err := store.AcquireCoordinator(ctx, info, ttl)
			if err != nil {
				t.Fatal(err)
			}
			info.Epoch = lease.Revision
			n := New(Config{Conn: nc, Store: store, Subjects: protocol.MustSubjects("", "", "kv"), Shards: tc.rows, LeaseTTL: ttl})
			l := &leader{Node: n, info: info, lease: lease, renewedAt: time.Now()}
			l.core, _ = NewCore(CoreConfig{Shards: tc.rows}, "c1", lease.Revision, nil, nil)
			l.track = newMoveTracker(n.cfg.Stats, nil, tc.rows, nil)
			defer l.track.stop()
			calls := 0
			l.clock = func() time.Time {
				calls++
				if calls == 2 {
					return time.Now().Add(600 * time.Millisecond)
				}
				return time.Now()
			}

			var acts []Action
			for sh := range tc.rows {
				acts = append(acts, WriteShard{Record: protocol.ShardRecord{Shard: sh, State: protocol.StateParked, Epoch: lease.Revision, Handoff: uint64(sh + 1)}})
			}
			if err := l.execute(ctx, acts); err != nil {
				t.Fatal(err)
			}
			if l.lease.Revision == lease.Revision {
				t.Fatalf("%d rows written one after another, the clock 600 ms ahead at its second reading, and the lease not renewed (%d readings)", tc.rows, calls)
			}
			table, err := store.Shards(ctx)
			if err != nil || len(table) != tc.rows {
				t.Fatalf("%d rows in the table (%v), want %d", len(table), err, tc.rows)
			}
		})
	}
}

// TestWaitsForWrites: the table writes held for a batch go before every
// action but log lines, the Park of a shard they do not touch and an
// Unpark (execute starts those after its last writes).
func TestWaitsForWrites(t *testing.T) {
	writes := []protocol.ShardRecord{{Shard: 1}, {Shard: 2}}
	for _, tc := range []struct {
		a    Action
		want bool
	}{
		{Park{Shard: 3}, false},
		{Park{Shard: 2}, true},
		{Warn{Msg: "x"}, false},
		{RoundPlanned{}, false},
		{RoundDone{}, false},
		{NoRound{}, false},
		{Send{Region: "r"}, true},
		{Unpark{Shard: 3}, false}, // gathered, and started after the last writes
		{Mark{Shard: 3}, true},
		{WritePin{Shard: 3}, true},
		{RemoveRegion{ID: "r"}, true},
		{StepDown{}, true},
	} {
		if got := waitsForWrites(tc.a, writes); got != tc.want {
			t.Errorf("%T %+v: waits %v, want %v", tc.a, tc.a, got, tc.want)
		}
	}
}

// TestSlowStartRenewsTheLease: a term's start-up reads (the table, the
// regions, the pins) took longer than its lease lets it go without
// renewing on a loaded machine, and every term stepped down as it began
// to lead. The lease is renewed while they run: here they take 5 s
// against a 2 s lease (renewed every 500 ms, given up 1.5 s after the
// last renewal), and the first term leads and stays.
func TestSlowStartRenewsTheLease(t *testing.T) {
	nc, store, buffer, subjects := openKV(t)
	ctx, cancel := context.WithCancel(context.Background())
	const ttl = 2 * time.Second
	stats := &Stats{}
	n := New(Config{Conn: nc, Store: store, Buffer: buffer, Subjects: subjects, Shards: 4, Region: "c1", LeaseTTL: ttl, Stats: stats,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	n.startHook = func(ctx context.Context) {
		select {
		case <-time.After(ttl * 5 / 2):
		case <-ctx.Done():
		}
	}
	done := make(chan struct{})
	go func() { defer close(done); n.Run(ctx) }()
	defer func() { cancel(); <-done }()

	natstest.Eventually(t, 20*time.Second, "a coordinator to answer", func() error {
		m, err := nc.Request(subjects.Admin(protocol.AdminStatus), nil, time.Second)
		if err == nil && m.Header.Get("Nats-Service-Error-Code") != "" {
			err = errors.New(m.Header.Get("Nats-Service-Error"))
		}
		if err != nil {
			return fmt.Errorf("%d terms begun, %d renewals failed: %w", stats.Terms.Load(), stats.RenewalsFailed.Load(), err)
		}
		return nil
	})
	// The lease renewed 8 times since (4 s, two TTLs): a term about to
	// step down would have by then.
	var lease uint64
	renewals := -1
	natstest.Eventually(t, 30*time.Second, "8 renewals of the lease", func() error {
		if _, rev, err := store.Coordinator(ctx); err == nil && rev != lease {
			lease, renewals = rev, renewals+1
		}
		if renewals < 8 {
			return fmt.Errorf("%d seen, %d terms begun", renewals, stats.Terms.Load())
		}
		return nil
	})
	if terms := stats.Terms.Load(); terms != 1 || !stats.Leading.Load() {
		t.Fatalf("%d terms begun, leading %v: want the first term leading still", terms, stats.Leading.Load())
	}
}

// TestLateLeaseKeepsItsEpoch: a lease acknowledged past its renewal
// deadline is renewed before the term leads (a loaded server). The term's
// epoch stays the revision the lease was taken at, which the lease's value
// carries and regions check commands against: a term that took the
// renewal's revision for its epoch had every command refused ("epoch N
// is not the coordinator lease's"), its shards binding until it ended.
func TestLateLeaseKeepsItsEpoch(t *testing.T) {
	const shards = 4
	nc, store, buffer, subjects := openKV(t)
	ctx, cancel := context.WithCancel(context.Background())
	agent, err := region.Open(ctx, region.Config{Conn: nc, Store: store, Buffer: buffer, Subjects: subjects, Shards: shards, ID: "r1", Factory: func(context.Context, string) (region.Entity, error) { return echo{}, nil }})
	if err != nil {
		t.Fatal(err)
	}
	defer agent.Close(context.Background())

	const ttl = 4 * time.Second
	n := New(Config{Conn: nc, Store: store, Buffer: buffer, Subjects: subjects, Shards: shards, Region: "c1", LeaseTTL: ttl,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	defer n.parker.stop()
	info := protocol.CoordinatorInfo{Region: "c1", Incarnation: "i1"}
	lease, err := store.AcquireCoordinator(ctx, info, ttl)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); n.term(ctx, info, lease, time.Now().Add(-time.Minute)) }() // acknowledged a minute after it was sent
	defer func() { cancel(); <-done }()

	natstest.Eventually(t, 20*time.Second, "every shard active on r1", func() error {
		rows, err := store.Shards(context.Background())
		active := 0
		for _, r := range rows {
			if r.State == protocol.StateActive && r.Region == "r1" {
				active++
				if r.Epoch != lease.Revision {
					t.Fatalf("shard %d written with epoch %d; the lease was taken at revision %d", r.Shard, r.Epoch, lease.Revision)
				}
			}
		}
		if err == nil && active != shards {
			err = fmt.Errorf("%d of %d: %+v", active, shards, rows)
		}
		return err
	})
	current, _, err := store.Coordinator(context.Background())
	if err != nil || current.Epoch != lease.Revision {
		t.Fatalf("the lease's value carries epoch %d (%v), want %d", current.Epoch, err, lease.Revision)
	}
}

// openKV starts a server and opens the KV bucket and the buffer of type
// kv on it (the external tests' openType, for this package's own).
func openKV(t *testing.T) (*nats.Conn, *kvstate.Store, *kvstate.Buffer, protocol.Subjects) {
	t.Helper()
	nc := natstest.Connect(t, natstest.URL(natstest.RunServer(t)))
	js := natstest.JetStream(t, nc)
	subjects := protocol.MustSubjects("", "", "kv")
	store, err := kvstate.Open(context.Background(), js, "kv", kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	buffer, err := kvstate.OpenBuffer(context.Background(), js, subjects, kvstate.BufferOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return nc, store, buffer, subjects
}

// echo answers each message with its data (entities.Echo, which this
// package's internal tests cannot import: it imports natshard, which
// imports this package).
type echo struct{}

func (echo) Handle(_ context.Context, m *region.Message) ([]byte, error) { return m.Data, nil }
func (echo) Stop(context.Context) error                                  { return nil }
