package main

import (
	"context"
	"fmt"
	"io"

	"github.com/natshard/natshard/protocol"
)

func cmdPin(ctx context.Context, c *client, args []string, out io.Writer) error {
	shard, region, err := c.parseShardRegion(args)
	if err != nil {
		return err
	}
	return c.change(ctx, out, protocol.AdminPin, protocol.PinRequest{Shard: shard, Region: region}, fmt.Sprintf("pinned shard %d to %s", shard, region), nil)
}

func cmdUnpin(ctx context.Context, c *client, args []string, out io.Writer) error {
	shard, err := c.parseShard(args[0])
	if err != nil {
		return err
	}
	return c.change(ctx, out, protocol.AdminUnpin, protocol.UnpinRequest{Shard: shard}, fmt.Sprintf("unpinned shard %d", shard), nil)
}
