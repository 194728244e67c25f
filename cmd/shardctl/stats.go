package main

import (
	"context"
	"fmt"
	"io"

	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

type statsJSON struct {
	Regions  []regionStats     `json:"regions"`
	Shards   []shardStats      `json:"shards"`
	Buffered uint64            `json:"buffered"`
	Failed   map[string]string `json:"failed,omitempty"`
}

// regionStats sums what a region reported for the shards it holds; null
// when it did not answer.
type regionStats struct {
	Region            string   `json:"region"`
	Shards            int      `json:"shards"`
	Entities          *int     `json:"entities"`
	MessagesPerSecond *float64 `json:"messages_per_second"`
}

// shardStats is a shard with what its owner (or, while it moves, its
// source) reported: null when no region reported it.
type shardStats struct {
	Shard             int      `json:"shard"`
	Region            string   `json:"region"`
	State             string   `json:"state"`
	Entities          *int     `json:"entities"`
	Buffered          uint64   `json:"buffered"`
	MessagesPerSecond *float64 `json:"messages_per_second"`
}

func cmdStats(ctx context.Context, c *client, _ []string, out io.Writer) error {
	v, err := c.view(ctx)
	if err != nil {
		return err
	}
	ids := make([]string, len(v.Regions))
	for i, r := range v.Regions {
		ids[i] = r.ID
	}
	answers, failed := c.askRegions(ctx, ids, protocol.QueryRequest{})
	bctx, cancel := context.WithTimeout(ctx, c.opts.Timeout)
	buffered, err := kvstate.BufferLengths(bctx, c.js, c.subjects)
	cancel()
	if err != nil {
		return c.jetStreamErr(err, "read the buffer lengths")
	}
	res := statsJSON{Regions: []regionStats{}, Shards: []shardStats{}}
	if len(failed) > 0 {
		res.Failed = failed
	}
	reports := map[string]map[int]protocol.ShardReport{}
	for _, r := range v.Regions {
		rs := regionStats{Region: r.ID, Shards: r.Shards}
		if ans, ok := answers[r.ID]; ok {
			n, rate := 0, 0.0
			reports[r.ID] = map[int]protocol.ShardReport{}
			for _, s := range ans.Shards {
				reports[r.ID][s.Shard] = s
				n += s.Entities
				rate += s.MessagesPerSecond
			}
			rs.Entities, rs.MessagesPerSecond = &n, &rate
		}
		res.Regions = append(res.Regions, rs)
	}
	for _, s := range v.Table {
		ss := shardStats{Shard: s.Shard, Region: s.Region, State: s.State, Buffered: buffered[s.Shard]}
		for _, id := range []string{s.Region, s.Source} {
			if rep, ok := reports[id][s.Shard]; ok && id != "" && ss.Entities == nil {
				ss.Entities, ss.MessagesPerSecond = &rep.Entities, &rep.MessagesPerSecond
			}
		}
		res.Buffered += ss.Buffered
		res.Shards = append(res.Shards, ss)
	}
	if c.opts.JSON {
		return writeJSON(out, res)
	}
	rows := make([][]any, len(res.Regions))
	for i, r := range res.Regions {
		rows[i] = []any{r.Region, r.Shards, orNull(r.Entities), rate(r.MessagesPerSecond)}
	}
	if err := table(out, []string{"REGION", "SHARDS", "ENTITIES", "MSG/S"}, rows); err != nil {
		return err
	}
	kvNote(out, v, 6)
	printFailed(out, res.Failed)
	fmt.Fprintf(out, "buffered: %d messages\n\n", res.Buffered)
	rows = make([][]any, len(res.Shards))
	for i, s := range res.Shards {
		rows[i] = []any{s.Shard, orDash(s.Region), s.State, orNull(s.Entities), s.Buffered, rate(s.MessagesPerSecond)}
	}
	return table(out, []string{"SHARD", "REGION", "STATE", "ENTITIES", "BUFFERED", "MSG/S"}, rows)
}

func orNull(n *int) any {
	if n == nil {
		return "-"
	}
	return *n
}

func rate(r *float64) string {
	if r == nil {
		return "-"
	}
	return fmt.Sprintf("%.1f", *r)
}
