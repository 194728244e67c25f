package kvstate

import (
	"context"
	"fmt"

	"github.com/natshard/natshard/protocol"
)

// The type's configuration (key config) is written by the first process
// of the type (EnsureConfig) and, when the type is resharded, by its
// coordinator (PutConfig, fenced on its lease like the shard table;
// docs/PROTOCOL.md, Resharding).

// PutConfig writes the type's configuration, fenced on the coordinator
// lease as PutShard is: the server refuses it (ErrFenced) unless the
// coordinator key's last revision is fence.Revision. The coordinator
// records and announces a split with it. cfg's counts must be a layout.
func (s *Store) PutConfig(ctx context.Context, fence Lease, cfg protocol.TypeConfig) (uint64, error) {
	if err := checkFence(fence, "PutConfig"); err != nil {
		return 0, err
	}
	if _, err := cfg.Layout(); err != nil {
		return 0, fmt.Errorf("kvstate: put config: %w", err)
	}
	return s.fencedPut(ctx, fence, KeyConfig, cfg, "put config")
}

// WatchConfig watches the type's configuration: first the stored one (if
// any), then every change. A value that does not decode, or whose counts
// are not a layout, is left out. The channel closes when ctx ends or the
// watch is lost (connection loss): watch again then, and read the
// configuration (a change may have been missed). The caller must keep
// reading the channel, or end ctx.
func (s *Store) WatchConfig(ctx context.Context) (<-chan protocol.TypeConfig, error) {
	ch, err := watch(s, ctx, KeyConfig, func(e kvEvent) (protocol.TypeConfig, bool) {
		var cfg protocol.TypeConfig
		if e.synced || e.deleted || protocol.Decode(e.value, &cfg) != nil {
			return cfg, false
		}
		if _, err := cfg.Layout(); err != nil {
			return cfg, false
		}
		return cfg, true
	})
	if err != nil {
		return nil, translate(fmt.Errorf("watch config: %w", err), ErrConflict)
	}
	return ch, nil
}
