package kvstate

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/protocol"
)

func TestEntityKey(t *testing.T) {
	for id, want := range map[string]string{
		"order-42":   "entities.order-42",
		"user.7":     "entities.user.7",
		"a_b/c-d.E9": "entities.a_b/c-d.E9",
		"a=b":        "entities.a=3Db",
		"a=3Db":      "entities.a=3D3Db",
		"x:y":        "entities.x=3Ay",
		"ü":          "entities.=C3=BC",
		"a b":        "entities.a=20b",
		"*>":         "entities.=2A=3E",
		"\x00\xff":   "entities.=00=FF",
	} {
		if got := EntityKey(id); got != want {
			t.Errorf("EntityKey(%q) = %q, want %q", id, got, want)
		}
	}
}

func TestTTLSeconds(t *testing.T) {
	for _, tc := range []struct {
		ttl  time.Duration
		want int64
	}{
		{time.Second, 1},
		{time.Second + time.Nanosecond, 2},
		{1500 * time.Millisecond, 2},
		{time.Minute, 60},
	} {
		if got, err := ttlSeconds(tc.ttl); err != nil || got != tc.want {
			t.Errorf("ttlSeconds(%v) = %d, %v; want %d", tc.ttl, got, err, tc.want)
		}
	}
	for _, ttl := range []time.Duration{0, -time.Second, 999 * time.Millisecond} {
		if _, err := ttlSeconds(ttl); err == nil {
			t.Errorf("ttlSeconds(%v) succeeded", ttl)
		}
	}
	if got := ttlHeader(5); got != "5s" {
		t.Errorf("ttlHeader(5) = %q", got)
	}
}

func TestTranslate(t *testing.T) {
	api := func(status int, code jetstream.ErrorCode) error {
		return fmt.Errorf("nats: %w", &jetstream.APIError{Code: status, ErrorCode: code, Description: "x"})
	}
	for _, tc := range []struct {
		name     string
		err      error
		conflict error
		want     error
	}{
		{"key not found", jetstream.ErrKeyNotFound, ErrConflict, ErrNotFound},
		{"key deleted", jetstream.ErrKeyDeleted, ErrConflict, ErrNotFound},
		{"no message", api(404, 10037), ErrConflict, ErrNotFound},
		{"wrong last seq", api(400, 10071), ErrConflict, ErrConflict},
		{"wrong last seq fenced", api(400, 10071), ErrFenced, ErrFenced},
		{"wrong last seq R>1", api(400, 10164), ErrConflict, ErrConflict},
		{"legacy wrong last seq", &nats.APIError{Code: 400, ErrorCode: 10071}, ErrConflict, ErrConflict},
		{"revision mismatch", jetstream.ErrKeyRevisionMismatch, ErrConflict, ErrConflict},
		{"timeout", nats.ErrTimeout, ErrConflict, ErrUnavailable},
		{"deadline", context.DeadlineExceeded, ErrConflict, ErrUnavailable},
		{"no responders", nats.ErrNoResponders, ErrConflict, ErrUnavailable},
		{"no stream response", jetstream.ErrNoStreamResponse, ErrConflict, ErrUnavailable},
		{"closed", nats.ErrConnectionClosed, ErrConflict, ErrUnavailable},
		{"js not enabled", jetstream.ErrJetStreamNotEnabled, ErrConflict, ErrUnavailable},
		{"js not enabled api", api(503, 10076), ErrConflict, ErrUnavailable},
		{"cluster not available", api(503, 10008), ErrConflict, ErrUnavailable},
		{"malformed", fmt.Errorf("x: %w", protocol.ErrMalformed), ErrConflict, ErrMalformed},
	} {
		got := translate(tc.err, tc.conflict)
		if !errors.Is(got, tc.want) || !errors.Is(got, tc.err) {
			t.Errorf("%s: translate(%v) = %v, want %v wrapping the original", tc.name, tc.err, got, tc.want)
		}
	}
	other := errors.New("other")
	if got := translate(other, ErrConflict); got != other {
		t.Errorf("translate(other) = %v", got)
	}
	own := fmt.Errorf("%w: x", ErrNotFound)
	if got := translate(own, ErrConflict); got != own {
		t.Errorf("translate(own) = %v", got)
	}
	if translate(nil, ErrConflict) != nil {
		t.Error("translate(nil) != nil")
	}
}

// TestFenceLockRenewalFirst: a renewal of the lease waiting for the fence
// lock goes before the fenced writes queued before it, once the write in
// flight is done. In a synctest bubble: synctest.Wait returns once every
// goroutine waits on the lock.
func TestFenceLockRenewalFirst(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var (
			f     fenceLock
			mu    sync.Mutex
			order []string
			wg    sync.WaitGroup
		)
		record := func(s string) {
			mu.Lock()
			order = append(order, s)
			mu.Unlock()
		}
		f.lockFenced() // a table write in flight
		for i := range 5 {
			wg.Go(func() {
				f.lockFenced()
				record(fmt.Sprint("write", i))
				f.unlockFenced()
			})
		}
		synctest.Wait() // the writes queue
		wg.Go(func() {
			f.Lock()
			record("renewal")
			f.Unlock()
		})
		synctest.Wait() // the renewal waits too
		if len(order) != 0 {
			t.Fatalf("order %v while a write held the lock", order)
		}
		f.unlockFenced()
		wg.Wait()
		if i := slices.Index(order, "renewal"); i != 0 {
			t.Fatalf("order %v: the renewal waited for %d queued writes", order, i)
		}
		if len(order) != 6 {
			t.Fatalf("order %v: want the renewal and 5 writes", order)
		}
	})
}

// entry is a KV entry as a watch delivers it.
type entry struct {
	key string
	rev uint64
	op  jetstream.KeyValueOp
}

func (e entry) Bucket() string                  { return "b" }
func (e entry) Key() string                     { return e.key }
func (e entry) Value() []byte                   { return nil }
func (e entry) Revision() uint64                { return e.rev }
func (e entry) Created() time.Time              { return time.Time{} }
func (e entry) Delta() uint64                   { return 0 }
func (e entry) Operation() jetstream.KeyValueOp { return e.op }

// TestSnapshotFromAReplicaBehind replays what watches placed on replicas
// that are behind deliver: a snapshot is complete only when its initial
// values reach the barrier and hold every key the leader had.
func TestSnapshotFromAReplicaBehind(t *testing.T) {
	keys := map[string]bool{"regions.r0": true, "regions.r1": true, "regions.r2": true}
	for _, tc := range []struct {
		name     string
		entries  []jetstream.KeyValueEntry
		complete bool
	}{{
		// Core seed 50 of the campaign: the leader's last revision among
		// the keys is 10, r2's registration at 9; the replica began the
		// watch at revision 5, where r2 was deleted; catching up, it held
		// r2's renewal at 12 before the watch reached 9, so 9 was gone,
		// and it delivered r1's renewal at 11 first.
		name: "behind the barrier",
		entries: []jetstream.KeyValueEntry{
			entry{"regions.r0", 3, jetstream.KeyValuePut},
			entry{"regions.r1", 4, jetstream.KeyValuePut},
			entry{"regions.r2", 5, jetstream.KeyValueDelete},
			nil, // end of the initial values
			entry{"regions.r1", 11, jetstream.KeyValuePut},
		},
	}, {
		// A replica rebuilding its store from the leader's after a
		// restart holds r0's latest renewal but not yet r1's or r2's,
		// which the leader wrote again since.
		name: "a key missing",
		entries: []jetstream.KeyValueEntry{
			entry{"regions.r0", 11, jetstream.KeyValuePut},
			nil,
			entry{"regions.r1", 12, jetstream.KeyValuePut},
			entry{"regions.r2", 13, jetstream.KeyValuePut},
		},
	}, {
		name: "caught up",
		entries: []jetstream.KeyValueEntry{
			entry{"regions.r0", 3, jetstream.KeyValuePut},
			entry{"regions.r2", 9, jetstream.KeyValuePut},
			entry{"regions.r1", 10, jetstream.KeyValuePut},
			nil,
		},
		complete: true,
	}} {
		sn := &snapshot{barrier: 10, keys: keys, last: map[string]jetstream.KeyValueEntry{}}
		for i, e := range tc.entries {
			sn.add(e)
			if sn.complete() && (!tc.complete || i < len(tc.entries)-1) {
				var live []string
				for _, e := range sn.live() {
					live = append(live, e.Key())
				}
				t.Fatalf("%s: complete after %d entries, with %v", tc.name, i+1, live)
			}
		}
		if sn.complete() != tc.complete || sn.behind() == tc.complete {
			t.Errorf("%s: complete %v, behind %v; want complete %v", tc.name, sn.complete(), sn.behind(), tc.complete)
		}
	}
}
