package main

import (
	"context"
	"io"
)

func cmdShards(ctx context.Context, c *client, _ []string, out io.Writer) error {
	v, err := c.view(ctx)
	if err != nil {
		return err
	}
	if c.opts.JSON {
		return writeJSON(out, v.Table)
	}
	rows := make([][]any, len(v.Table))
	for i, r := range v.Table {
		rows[i] = []any{r.Shard, orDash(r.Region), r.State}
	}
	return table(out, []string{"SHARD", "REGION", "STATE"}, rows)
}
