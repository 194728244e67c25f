package main

import (
	"context"
	"fmt"
	"io"
	"strings"

	"github.com/natshard/natshard/protocol"
)

type regionJSON struct {
	Region protocol.RegionView `json:"region"`
	// Shards as the region reports them; when it did not answer, the
	// shards the coordinator's table gives it, with mode "unknown".
	Shards []protocol.ShardReport `json:"shards"`
	Failed map[string]string      `json:"failed,omitempty"`
}

func cmdRegion(ctx context.Context, c *client, args []string, out io.Writer) error {
	id, err := parseRegion(args[0])
	if err != nil {
		return err
	}
	v, err := c.view(ctx)
	if err != nil {
		return err
	}
	res := regionJSON{Shards: []protocol.ShardReport{}}
	found := false
	var known []string
	for _, r := range v.Regions {
		known = append(known, r.ID)
		if r.ID == id {
			res.Region, found = r, true
		}
	}
	if !found {
		return fmt.Errorf("no region %q is registered (regions: %s)", id, orDash(strings.Join(known, ", ")))
	}
	answers, failed := c.askRegions(ctx, []string{id}, protocol.QueryRequest{Entities: true, Limit: c.opts.Limit})
	if ans, ok := answers[id]; ok {
		res.Shards = ans.Shards
	} else {
		res.Failed = failed
		for _, s := range v.Table {
			if s.Region == id {
				res.Shards = append(res.Shards, protocol.ShardReport{Shard: s.Shard, Mode: "unknown"})
			}
		}
	}
	if c.opts.JSON {
		return writeJSON(out, res)
	}
	entities := 0
	for _, s := range res.Shards {
		entities += s.Entities
	}
	say(out, "region:      %s\n", res.Region.ID)
	say(out, "incarnation: %s\n", res.Region.Incarnation)
	say(out, "version:     %s\n", orDash(res.Region.Version))
	fmt.Fprintf(out, "leaving:     %v\n", res.Region.Leaving)
	fmt.Fprintf(out, "shards:      %d\n", len(res.Shards))
	if res.Failed == nil {
		fmt.Fprintf(out, "entities:    %d\n", entities)
	}
	kvNote(out, v, 13)
	printFailed(out, res.Failed)
	if len(res.Shards) == 0 {
		return nil
	}
	fmt.Fprintln(out)
	rows := make([][]any, len(res.Shards))
	for i, s := range res.Shards {
		if res.Failed != nil {
			rows[i] = []any{s.Shard, s.Mode, "-", "-"}
		} else {
			rows[i] = []any{s.Shard, s.Mode, s.Entities, idList(s)}
		}
	}
	return table(out, []string{"SHARD", "MODE", "ENTITIES", "ENTITY IDS"}, rows)
}
