package main

import (
	"context"
	"fmt"
	"io"

	"github.com/natshard/natshard/protocol"
)

func cmdPin(ctx context.Context, c *client, args []string, out io.Writer) error {
	shard, err := c.parseShard(args[0])
	if err != nil {
		return err
	}
	region, err := parseRegion(args[1])
	if err != nil {
		return err
	}
	var ans protocol.AdminOK
	if err := c.admin(ctx, protocol.AdminPin, protocol.PinRequest{Shard: shard, Region: region}, &ans); err != nil {
		return err
	}
	return c.report(out, fmt.Sprintf("pinned shard %d to %s", shard, region), ans.Note)
}

func cmdUnpin(ctx context.Context, c *client, args []string, out io.Writer) error {
	shard, err := c.parseShard(args[0])
	if err != nil {
		return err
	}
	var ans protocol.AdminOK
	if err := c.admin(ctx, protocol.AdminUnpin, protocol.UnpinRequest{Shard: shard}, &ans); err != nil {
		return err
	}
	return c.report(out, fmt.Sprintf("unpinned shard %d", shard), ans.Note)
}
