// Package hosttest has what the tests and benchmarks of the entity
// runtime (internal/host) and of the region share: the cheapest entity,
// which counts what it handled, entity ids spread over the
// shards, and a clock to set by hand. The runtime's own tests import it,
// so it does not import the runtime: the entity is generic in the message
// type (Entity[*host.Message] is a host.Entity).
package hosttest

import (
	"context"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/natshard/natshard/protocol"
)

// Handled counts the messages the Entity values handled.
var Handled atomic.Int64

// Entity is as cheap as an entity can be: zero-size, no state, no answer
// (the benchmarks send no request); it counts what it handles in Handled.
type Entity[M any] struct{}

// Handle counts the message.
func (Entity[M]) Handle(context.Context, M) ([]byte, error) {
	Handled.Add(1)
	return nil, nil
}

// Stop does nothing.
func (Entity[M]) Stop(context.Context) error { return nil }

// WaitHandled waits until Handled reaches n, at most a minute.
func WaitHandled(tb testing.TB, n int64) {
	deadline := time.Now().Add(time.Minute)
	for Handled.Load() < n {
		if time.Now().After(deadline) {
			tb.Fatalf("handled %d of %d messages", Handled.Load(), n)
		}
		runtime.Gosched()
	}
}

// IDs returns n entity ids and their shards among protocol.DefaultShards.
func IDs(n int) ([]string, []int) {
	ids, shards := make([]string, n), make([]int, n)
	for i := range ids {
		ids[i] = "entity-" + strconv.Itoa(i)
		shards[i] = protocol.ShardOf(ids[i], protocol.DefaultShards)
	}
	return ids, shards
}

// Clock is a clock set by hand (Advance), safe for concurrent use.
type Clock struct {
	mu sync.Mutex
	t  time.Time
}

// NewClock returns a Clock at a fixed time.
func NewClock() *Clock { return &Clock{t: time.Unix(1_700_000_000, 0)} }

// Now is the clock's time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

// Advance moves the clock on by d.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}
