package main

import (
	"context"
	"fmt"
	"io"

	"github.com/natshard/natshard/protocol"
)

type location struct {
	Entity  string `json:"entity"`
	Shard   int    `json:"shard"`
	Subject string `json:"subject"`
	Region  string `json:"region"`
	State   string `json:"state"`
}

func cmdLocate(ctx context.Context, c *client, args []string, out io.Writer) error {
	id := args[0]
	if err := protocol.ValidateEntityID(id); err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	v, err := c.view(ctx)
	if err != nil {
		return err
	}
	shard := protocol.ShardOf(id, c.shards)
	loc := location{Entity: id, Shard: shard, Subject: c.subjects.Entity(shard, id), State: string(protocol.StateUnowned)}
	if shard < len(v.Table) {
		loc.Region, loc.State = v.Table[shard].Region, v.Table[shard].State
	}
	if c.opts.JSON {
		return writeJSON(out, loc)
	}
	return table(out, []string{"ENTITY", "SHARD", "SUBJECT", "REGION", "STATE"},
		[][]any{{loc.Entity, loc.Shard, loc.Subject, orDash(loc.Region), loc.State}})
}
