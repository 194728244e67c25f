package main

import (
	"context"
	"fmt"
	"io"
	"sort"

	"github.com/natshard/natshard/protocol"
)

type shardJSON struct {
	protocol.ShardView
	Subject string `json:"subject"`
	// HeldBy lists the regions that hold the shard, as they report it:
	// its owner, and during a move its source too.
	HeldBy []heldJSON        `json:"held_by"`
	Failed map[string]string `json:"failed,omitempty"`
}

type heldJSON struct {
	Region string `json:"region"`
	protocol.ShardReport
}

func cmdShard(ctx context.Context, c *client, args []string, out io.Writer) error {
	shard, err := c.parseShard(args[0])
	if err != nil {
		return err
	}
	v, err := c.view(ctx)
	if err != nil {
		return err
	}
	res := shardJSON{ShardView: protocol.ShardView{Shard: shard, State: string(protocol.StateUnowned)}, Subject: c.subjects.Shard(shard), HeldBy: []heldJSON{}}
	if shard < len(v.Table) {
		res.ShardView = v.Table[shard]
	}
	var ask []string
	for _, id := range []string{res.Region, res.Source} {
		if id != "" {
			ask = append(ask, id)
		}
	}
	answers, failed := c.askRegions(ctx, ask, protocol.QueryRequest{Shards: []int{shard}, Entities: true, Limit: c.opts.Limit})
	if len(failed) > 0 {
		res.Failed = failed
	}
	for _, id := range ask {
		for _, r := range answers[id].Shards {
			res.HeldBy = append(res.HeldBy, heldJSON{Region: id, ShardReport: r})
		}
	}
	sort.Slice(res.HeldBy, func(i, j int) bool { return res.HeldBy[i].Region < res.HeldBy[j].Region })
	if c.opts.JSON {
		return writeJSON(out, res)
	}
	say(out, "shard:    %d\n", res.Shard)
	say(out, "subject:  %s\n", res.Subject)
	say(out, "region:   %s\n", orDash(res.Region))
	say(out, "state:    %s\n", res.State)
	if res.State == string(protocol.StateHandoff) || res.State == string(protocol.StateBinding) {
		from := res.Source
		if from == "" {
			from = "(coordinator)"
		}
		say(out, "from:     %s\n", from)
	}
	say(out, "pin:      %s\n", orDash(res.Pin))
	kvNote(out, v, 10)
	printFailed(out, res.Failed)
	if len(res.HeldBy) == 0 {
		fmt.Fprintln(out, "held by:  no region")
		return nil
	}
	fmt.Fprintln(out)
	rows := make([][]any, len(res.HeldBy))
	for i, h := range res.HeldBy {
		rows[i] = []any{h.Region, h.Mode, h.Entities, idList(h.ShardReport)}
	}
	return table(out, []string{"REGION", "MODE", "ENTITIES", "ENTITY IDS"}, rows)
}
