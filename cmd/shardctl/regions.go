package main

import (
	"context"
	"io"
)

func cmdRegions(ctx context.Context, c *client, _ []string, out io.Writer) error {
	v, err := c.view(ctx)
	if err != nil {
		return err
	}
	if c.opts.JSON {
		return writeJSON(out, v.Regions)
	}
	rows := make([][]any, len(v.Regions))
	for i, r := range v.Regions {
		rows[i] = []any{r.ID, r.Shards, orDash(r.Version), r.Leaving, r.Incarnation}
	}
	return table(out, []string{"REGION", "SHARDS", "VERSION", "LEAVING", "INCARNATION"}, rows)
}
