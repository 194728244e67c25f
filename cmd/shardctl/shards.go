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
		from := "-"
		if r.State == "handoff" || r.State == "binding" {
			from = r.Source
			if from == "" {
				from = "(coordinator)"
			}
		}
		rows[i] = []any{r.Shard, orDash(r.Region), r.State, from, orDash(r.Pin)}
	}
	return table(out, []string{"SHARD", "REGION", "STATE", "FROM", "PIN"}, rows)
}
