package natshard

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// A ReshardOption configures Reshard.
type ReshardOption func(*reshardOptions)

type reshardOptions struct {
	control  string
	progress func(string)
}

// ReshardControlPrefix sets the control-plane subject prefix of the type
// (Options.ControlPrefix of its nodes; default "$SHARD").
func ReshardControlPrefix(p string) ReshardOption {
	return func(o *reshardOptions) { o.control = p }
}

// ReshardProgress has Reshard tell f what it waits for (shards moving, no
// coordinator yet, regions splitting), one line at a time.
func ReshardProgress(f func(string)) ReshardOption {
	return func(o *reshardOptions) { o.progress = f }
}

// Reshard splits every shard of entity type typ so that the type has
// shards shards, a larger multiple of its count (docs/PROTOCOL.md,
// Resharding): each shard's children start on its region, no entity moves,
// and rebalancing spreads them afterwards. It asks the type's coordinator
// over its admin API on nc, again while shards are moving (or no
// coordinator answers), then waits, watching the type's configuration,
// until the split is announced: every region split, and clients use the
// new count. It returns the count the type had. A type that has shards
// shards already returns at once. ctx bounds it all; a split the
// coordinator recorded goes on when ctx ends (the error says so).
func Reshard(ctx context.Context, nc *nats.Conn, typ string, shards int, opts ...ReshardOption) (from int, err error) {
	var o reshardOptions
	for _, opt := range opts {
		opt(&o)
	}
	say := func(format string, args ...any) {
		if o.progress != nil {
			o.progress(fmt.Sprintf(format, args...))
		}
	}
	subjects, err := protocol.NewSubjects("", o.control, typ)
	if err != nil {
		return 0, fmt.Errorf("natshard: reshard: %w", err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return 0, fmt.Errorf("natshard: reshard: %w", err)
	}
	store, err := kvstate.Bind(ctx, js, typ, kvstate.Options{})
	if errors.Is(err, kvstate.ErrNotFound) {
		return 0, fmt.Errorf("%w %q: NATS has no bucket %s", ErrUnknownType, typ, kvstate.BucketName(typ))
	}
	if err != nil {
		return 0, fmt.Errorf("natshard: reshard type %q: %w", typ, err)
	}
	// A daemon's worker ids are made for its shard count (its workers
	// would change entity), so a daemon keeps the count it was made with.
	if _, _, err := store.DaemonWorkers(ctx); err == nil {
		return 0, fmt.Errorf("natshard: reshard type %q: %w: a daemon's workers are placed by its shard count, which cannot change", typ, ErrBadRequest)
	} else if !errors.Is(err, kvstate.ErrNotFound) {
		return 0, fmt.Errorf("natshard: reshard type %q: %w", typ, err)
	}
	watch, err := store.WatchConfig(ctx)
	if err != nil {
		return 0, fmt.Errorf("natshard: reshard type %q: watch its configuration: %w", typ, err)
	}
	var cfg protocol.TypeConfig
	select {
	case cfg = <-watch:
	case <-ctx.Done():
		return 0, fmt.Errorf("natshard: reshard type %q: read its configuration: %w", typ, ctx.Err())
	}
	from = cfg.Shards
	if cfg.Shards == shards && cfg.To == 0 {
		return from, nil
	}
	// The request and the watch at once: a coordinator that dies after
	// it recorded the split leaves the request unanswered, and the next
	// one completes the split, which the watch sees.
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	asked := make(chan error, 1)
	go func() { asked <- askReshard(actx, nc, subjects, shards, say) }()
	recorded := false
	for cfg.Shards != shards || cfg.To != 0 {
		if !recorded && cfg.To == shards {
			recorded = true
			say("split from %d to %d shards recorded; waiting for every region to split", from, shards)
		}
		select {
		case err := <-asked:
			asked = nil
			if err != nil {
				return from, fmt.Errorf("natshard: reshard type %q to %d shards: %w", typ, shards, err)
			}
		case c, ok := <-watch:
			if ok {
				cfg = c
				continue
			}
			// The watch was lost (a reconnect): watch again, from the
			// stored configuration.
			if nc.IsClosed() {
				return from, fmt.Errorf("natshard: reshard type %q: %w", typ, nats.ErrConnectionClosed)
			}
			time.Sleep(100 * time.Millisecond)
			if w, err := store.WatchConfig(ctx); err == nil {
				watch = w
			}
		case <-ctx.Done():
			if !recorded {
				return from, fmt.Errorf("natshard: reshard type %q to %d shards: %w", typ, shards, ctx.Err())
			}
			return from, fmt.Errorf("natshard: reshard type %q: the split to %d shards is recorded, not announced yet (a region has not split: the coordinator's log names it); it goes on: %w", typ, shards, ctx.Err())
		}
	}
	return from, nil
}

// askReshard sends the admin request until the coordinator records the
// split or refuses it for good.
func askReshard(ctx context.Context, nc *nats.Conn, subjects protocol.Subjects, shards int, say func(string, ...any)) error {
	body, err := json.Marshal(protocol.ReshardRequest{Shards: shards})
	if err != nil {
		return err
	}
	for backoff := 100 * time.Millisecond; ; backoff = min(2*backoff, 2*time.Second) {
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		m, err := nc.RequestWithContext(rctx, subjects.Admin(protocol.AdminReshard), body)
		cancel()
		var ans protocol.AdminError
		switch {
		case errors.Is(err, nats.ErrNoResponders):
			say("no coordinator answers; asking again")
		case err != nil && ctx.Err() == nil:
			say("the coordinator did not answer (%v); asking again", err)
		case err != nil:
			return err
		case json.Unmarshal(m.Data, &ans) != nil:
			return fmt.Errorf("the coordinator answered garbage: %q", m.Data)
		case ans.Error == "":
			return nil
		case !ans.Retry:
			return errors.New(ans.Error)
		default:
			say("%s; asking again", ans.Error)
		}
		select {
		case <-ctx.Done():
			if err == nil {
				err = errors.New(ans.Error)
			}
			return fmt.Errorf("%w (last: %v)", ctx.Err(), err)
		case <-time.After(backoff):
		}
	}
}

// Reshard splits every shard of type name so that it has shards shards
// (the package function Reshard, on the node's connection and control
// prefix; any node of the type, or none, may lead it).
func (n *Node) Reshard(ctx context.Context, name string, shards int) (from int, err error) {
	return Reshard(ctx, n.nc, name, shards, ReshardControlPrefix(n.opts.ControlPrefix))
}
