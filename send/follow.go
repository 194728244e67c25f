package send

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// The shard counts the clients of a connection send by: one per type,
// learnt once, then followed by one watch of the type's configuration for
// as long as the connection lives (resharding: docs/PROTOCOL.md).

// counts are a connection's shard counts, by type.
type counts struct {
	nc *nats.Conn
	mu sync.Mutex
	by map[string]*atomic.Int64
}

// countsOf holds every connection's counts; an entry is dropped when its
// connection closes.
var countsOf sync.Map // *nats.Conn -> *counts

// countOf returns the shard count connection nc's clients send type typ
// by, learnt now as shards unless learnt before, and starts its watch
// the first time.
func countOf(nc *nats.Conn, typ string, shards int) *atomic.Int64 {
	v, _ := countsOf.LoadOrStore(nc, &counts{nc: nc, by: map[string]*atomic.Int64{}})
	cs := v.(*counts)
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if n, ok := cs.by[typ]; ok {
		return n
	}
	n := new(atomic.Int64)
	n.Store(int64(shards))
	cs.by[typ] = n
	go cs.follow(typ, n)
	return n
}

// follow watches type typ's configuration for as long as the connection
// lives, and stores the count it announces in n (a split's: every region
// serves the new shards by then).
func (cs *counts) follow(typ string, n *atomic.Int64) {
	defer func() {
		if cs.nc.IsClosed() {
			countsOf.CompareAndDelete(cs.nc, cs)
		}
	}()
	js, err := jetstream.New(cs.nc)
	if err != nil {
		return
	}
	for wait := time.Duration(0); !cs.nc.IsClosed(); wait = min(2*wait+100*time.Millisecond, 5*time.Second) {
		time.Sleep(wait)
		ctx, cancel := context.WithTimeout(context.Background(), attemptTimeout)
		store, err := kvstate.Bind(ctx, js, typ, kvstate.Options{})
		cancel()
		if err != nil {
			continue
		}
		configs, err := store.WatchConfig(context.Background()) // ends with the connection
		if err != nil {
			continue
		}
		for cfg := range configs {
			if cfg.Shards >= 1 && cfg.Shards <= protocol.MaxShards {
				n.Store(int64(cfg.Shards))
			}
			wait = 0
		}
	}
}
