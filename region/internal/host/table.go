package host

import (
	"iter"
	"sync/atomic"

	"github.com/natshard/natshard/protocol"
)

// shardTable maps shard numbers to their entities for lookups without a
// lock: pages of shardPage slots, each page made when a shard of its
// range first comes. A change writes one slot (under host.mu), where the
// copy of a map that this table replaced cost O(shards held) per change
// (BenchmarkTakeShards; its figures on both in docs/BENCHMARKS.md). A shard
// out of range (protocol.MaxShards; region.Open refuses more) is never
// held.
type shardTable struct {
	pages [protocol.MaxShards / shardPage]atomic.Pointer[[shardPage]atomic.Pointer[shardEntities]]
}

// shardPage is the number of slots in a page: 2 KiB of pointers.
const shardPage = 256

// get returns shard's entities, nil if none or if shard is out of range.
func (t *shardTable) get(shard int) *shardEntities {
	if uint(shard) >= protocol.MaxShards {
		return nil
	}
	if p := t.pages[shard/shardPage].Load(); p != nil {
		return p[shard%shardPage].Load()
	}
	return nil
}

// set makes se shard's entities (nil: none); the caller holds host.mu.
func (t *shardTable) set(shard int, se *shardEntities) {
	if uint(shard) >= protocol.MaxShards {
		return
	}
	p := t.pages[shard/shardPage].Load()
	if p == nil {
		p = new([shardPage]atomic.Pointer[shardEntities])
		t.pages[shard/shardPage].Store(p)
	}
	p[shard%shardPage].Store(se)
}

// each yields the shards held, in shard order, without a lock: a shard
// that comes or goes meanwhile may or may not be seen. The periodic walks
// (passivation, stop, status) take it; each locks the shards it looks
// into, and the message path uses get.
func (t *shardTable) each() iter.Seq[*shardEntities] {
	return func(yield func(*shardEntities) bool) {
		for i := range t.pages {
			p := t.pages[i].Load()
			if p == nil {
				continue
			}
			for j := range p {
				if se := p[j].Load(); se != nil && !yield(se) {
					return
				}
			}
		}
	}
}
