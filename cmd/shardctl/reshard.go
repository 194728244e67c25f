package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/natshard/natshard/protocol"
)

// reshardResult is what reshard prints with --json.
type reshardResult struct {
	Type string `json:"type"`
	From int    `json:"from"`
	To   int    `json:"to"`
	// TookMS is the time from the first request to the announce (every
	// region split): what the split took.
	TookMS int64 `json:"took_ms"`
}

// cmdReshard asks the coordinator to split the type to --shards shards,
// again while it answers that shards are moving, then waits, on a watch
// of the type's configuration, until the split is announced.
func cmdReshard(ctx context.Context, c *client, _ []string, out io.Writer) error {
	want := c.opts.Shards
	watch, err := c.store.WatchConfig(ctx)
	if err != nil {
		return c.jetStreamErr(err, "watch the type's configuration")
	}
	var cfg protocol.TypeConfig
	select {
	case cfg = <-watch:
	case <-ctx.Done():
		return fmt.Errorf("reshard: cannot read the type's configuration: %w", ctx.Err())
	}
	res := reshardResult{Type: c.opts.Type, From: cfg.Shards, To: want}
	if cfg.Shards == want && cfg.To == 0 {
		if c.opts.JSON {
			return writeJSON(out, res)
		}
		say(out, "type %s has %d shards already\n", c.opts.Type, want)
		return nil
	}
	start := time.Now()
	for backoff := 100 * time.Millisecond; ; backoff = min(2*backoff, 2*time.Second) {
		err = c.admin(ctx, protocol.AdminReshard, protocol.ReshardRequest{Shards: want}, nil)
		var r *refusal
		if err == nil || !errors.As(err, &r) || !r.Retry {
			break
		}
		fmt.Fprintf(c.stderr, "%s; asking again\n", r.AdminError.Error)
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (gave up after --timeout %v)", err, c.opts.Timeout)
		case <-time.After(backoff):
		}
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(c.stderr, "split from %d to %d shards recorded; waiting for every region to split\n", res.From, want)
	for cfg.Shards != want || cfg.To != 0 {
		var ok bool
		select {
		case cfg, ok = <-watch:
			if !ok {
				return errors.New("reshard: the watch of the type's configuration ended (connection lost); the split goes on: shardctl status shows it")
			}
		case <-ctx.Done():
			return fmt.Errorf("reshard: the split to %d shards is recorded but not announced after %v: a region has not split yet (shardctl regions; the coordinator's log names it); it goes on", want, c.opts.Timeout)
		}
	}
	res.TookMS = time.Since(start).Milliseconds()
	if c.opts.JSON {
		return writeJSON(out, res)
	}
	say(out, "type %s resharded from %d to %d shards in %v\n", c.opts.Type, res.From, want, time.Since(start).Round(time.Millisecond))
	return nil
}
