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
// (in the background) the first time.
func countOf(nc *nats.Conn, typ string, shards int) *atomic.Int64 {
	cs, n, fresh := entry(nc, typ, shards)
	if fresh {
		go cs.follow(typ, n, nil)
	}
	return n
}

// follow is countOf for a client that reads the type's configuration
// itself (js, on nc): the watch has begun when it returns (the
// subscriptions a connection's clients make are there after their first
// message, not some time later).
func follow(nc *nats.Conn, js jetstream.JetStream, typ string, shards int) {
	cs, n, fresh := entry(nc, typ, shards)
	if !fresh {
		return
	}
	var configs <-chan protocol.TypeConfig
	ctx, cancel := context.WithTimeout(context.Background(), attemptTimeout)
	store, err := kvstate.Bind(ctx, js, typ, kvstate.Options{})
	cancel()
	if err == nil {
		configs, _ = store.WatchConfig(context.Background()) // ends with the connection
	}
	go cs.follow(typ, n, configs)
}

// entry returns nc's count of typ, made now (fresh) as shards if new.
func entry(nc *nats.Conn, typ string, shards int) (*counts, *atomic.Int64, bool) {
	v, _ := countsOf.LoadOrStore(nc, &counts{nc: nc, by: map[string]*atomic.Int64{}})
	cs := v.(*counts)
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if n, ok := cs.by[typ]; ok {
		return cs, n, false
	}
	n := new(atomic.Int64)
	n.Store(int64(shards))
	cs.by[typ] = n
	return cs, n, true
}

// follow watches type typ's configuration for as long as the connection
// lives, and stores the count it announces in n (a split's: every region
// serves the new shards by then).
func (cs *counts) follow(typ string, n *atomic.Int64, configs <-chan protocol.TypeConfig) {
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
		if configs == nil {
			time.Sleep(wait)
			ctx, cancel := context.WithTimeout(context.Background(), attemptTimeout)
			store, err := kvstate.Bind(ctx, js, typ, kvstate.Options{})
			cancel()
			if err != nil {
				continue
			}
			if configs, err = store.WatchConfig(context.Background()); err != nil { // ends with the connection
				configs = nil
				continue
			}
		}
		for cfg := range configs {
			if cfg.Shards >= 1 && cfg.Shards <= protocol.MaxShards {
				n.Store(int64(cfg.Shards))
			}
			wait = 0
		}
		configs = nil
	}
}
