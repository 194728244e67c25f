package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/natshard/natshard"
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

// cmdReshard splits the type to --shards shards (natshard.Reshard: the
// coordinator is asked again while shards move, and the split is followed
// until it is announced), and prints what it took.
func cmdReshard(ctx context.Context, c *client, _ []string, out io.Writer) error {
	start := time.Now()
	from, err := natshard.Reshard(ctx, c.nc, c.opts.Type, c.opts.Shards,
		natshard.ReshardControlPrefix(c.opts.ControlPrefix),
		natshard.ReshardProgress(func(line string) { fmt.Fprintln(c.stderr, line) }))
	if err != nil {
		if d := c.deniedAfterFlush(); d != nil {
			return d
		}
		return err
	}
	res := reshardResult{Type: c.opts.Type, From: from, To: c.opts.Shards, TookMS: time.Since(start).Milliseconds()}
	if c.opts.JSON {
		return writeJSON(out, res)
	}
	if from == c.opts.Shards {
		say(out, "type %s has %d shards already\n", c.opts.Type, from)
		return nil
	}
	say(out, "type %s resharded from %d to %d shards in %v\n", c.opts.Type, from, c.opts.Shards, time.Since(start).Round(time.Millisecond))
	return nil
}
