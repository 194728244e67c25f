package coordinator

import (
	"bytes"
	"fmt"
	"maps"
	"slices"

	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/strategies"
)

// This file holds the operators' requests that change what the strategy
// decides: pins and rebalance rounds on demand (shardctl pin, unpin,
// rebalance), and the admin API's decoding of every request but status.
// Move and Drain are in core.go.

// AdminRequest decodes and applies an admin API request (JSON body data,
// strictly decoded) for every verb but status, which the driver answers.
// It returns the answer's body (AdminOK, or RebalanceAnswer) and the
// actions to carry out before answering; an error says what is wrong with
// the request, and then nothing changed.
func (c *Core) AdminRequest(verb string, data []byte) (body any, acts []Action, err error) {
	var note string
	switch verb {
	case protocol.AdminMove:
		var req protocol.MoveRequest
		if err = protocol.DecodeJSON(data, &req); err == nil {
			acts, err = c.Move(req.Shard, req.Region)
			if err == nil && len(acts) == 0 {
				note = fmt.Sprintf("shard %d is on %s already", req.Shard, req.Region)
			}
		}
	case protocol.AdminDrain:
		var req protocol.DrainRequest
		if err = protocol.DecodeJSON(data, &req); err == nil {
			acts, err = c.Drain(req.Region)
		}
	case protocol.AdminPin:
		var req protocol.PinRequest
		if err = protocol.DecodeJSON(data, &req); err == nil {
			acts, note, err = c.Pin(req.Shard, req.Region)
		}
	case protocol.AdminUnpin:
		var req protocol.UnpinRequest
		if err = protocol.DecodeJSON(data, &req); err == nil {
			acts, note, err = c.Unpin(req.Shard)
		}
	case protocol.AdminRebalance:
		var req protocol.RebalanceRequest
		if len(bytes.TrimSpace(data)) > 0 { // an empty body runs a round
			err = protocol.DecodeJSON(data, &req)
		}
		if err == nil {
			var ans protocol.RebalanceAnswer
			ans, acts = c.Rebalance(req.DryRun)
			return ans, acts, nil
		}
	default:
		err = fmt.Errorf("unknown admin verb %q (verbs: status, move, drain, pin, unpin, rebalance)", verb)
	}
	if err != nil {
		return nil, nil, err
	}
	return protocol.AdminOK{OK: true, Note: note}, acts, nil
}

// Pin pins shard to region: from now on the strategy allocates it there
// and rebalance rounds move it there whenever the region is registered and
// not leaving. The region need not be registered yet. The returned
// actions write the pin (WritePin); note says what happens next.
func (c *Core) Pin(shard int, region string) (acts []Action, note string, err error) {
	if err := c.checkShard(shard); err != nil {
		return nil, "", err
	}
	if err := protocol.ValidateName("region id", region); err != nil {
		return nil, "", fmt.Errorf("%w: %w", ErrBadRequest, err)
	}
	r, live := c.regions[region]
	rec := c.table[shard]
	switch {
	case !live:
		note = fmt.Sprintf("region %s is not registered: the pin takes effect when it is", region)
	case r.Info.Leaving:
		note = fmt.Sprintf("region %s is leaving: the pin takes effect if it comes back", region)
	case rec.Region == region && rec.State == protocol.StateActive:
		note = fmt.Sprintf("shard %d is on %s already", shard, region)
	case c.cfg.RebalanceEvery < 0:
		note = fmt.Sprintf("shard %d moves to %s in the next round (periodic rounds are off: shardctl rebalance runs one)", shard, region)
	default:
		note = fmt.Sprintf("shard %d moves to %s in the next rebalance round", shard, region)
	}
	if c.pins[shard] == region {
		return nil, note, nil
	}
	c.pins[shard] = region
	c.strategy = strategies.NewExternal(c.pins, c.cfg.Strategy)
	c.out = append(c.out, WritePin{Shard: shard, Region: region})
	return c.flush(), note, nil
}

// Unpin removes shard's pin; the shard stays where it is until the
// strategy moves it. Unpinning a shard that is not pinned does nothing.
func (c *Core) Unpin(shard int) (acts []Action, note string, err error) {
	if err := c.checkShard(shard); err != nil {
		return nil, "", err
	}
	if _, ok := c.pins[shard]; !ok {
		return nil, fmt.Sprintf("shard %d was not pinned", shard), nil
	}
	delete(c.pins, shard)
	c.strategy = strategies.NewExternal(c.pins, c.cfg.Strategy)
	c.out = append(c.out, WritePin{Shard: shard})
	if r := c.table[shard].Region; r != "" {
		note = fmt.Sprintf("shard %d stays on %s until a rebalance round moves it", shard, r)
	}
	return c.flush(), note, nil
}

// Pins returns a copy of the pins.
func (c *Core) Pins() map[int]string { return maps.Clone(c.pins) }

// Rebalance runs a strategy round now, whatever the rebalance interval
// and recent membership changes (the strategy's own gates still hold:
// most do nothing while shards are in progress). It returns the moves with
// the region the strategy would place each shard on now, and, unless
// dryRun, starts them (the target is chosen again when each shard has
// paused). The periodic round counts from now.
func (c *Core) Rebalance(dryRun bool) (protocol.RebalanceAnswer, []Action) {
	moves, busy := c.round()
	ans := protocol.RebalanceAnswer{DryRun: dryRun, Moves: c.plan(moves), InProgress: busy}
	if dryRun {
		return ans, nil
	}
	c.lastRound = c.tick
	for _, sh := range moves {
		c.startMove(sh)
	}
	return ans, c.flush()
}

// plan predicts where moves go: all of them leave their regions first,
// then each is placed through the strategy in order, as the coordinator
// does when their handoffs complete (without offering a shard its own
// source region).
func (c *Core) plan(moves []int) []protocol.PlannedMove {
	view := c.strategyView("")
	moving := map[int]bool{}
	for _, sh := range moves {
		moving[sh] = true
	}
	for i := range view {
		r := &view[i]
		var shards []int
		var load []strategies.ShardLoad
		for j, sh := range r.Shards {
			if moving[sh] {
				continue
			}
			shards = append(shards, sh)
			if j < len(r.Load) {
				load = append(load, r.Load[j])
			}
		}
		r.Shards, r.Load = shards, load
	}
	out := make([]protocol.PlannedMove, len(moves))
	for k, sh := range moves {
		from := c.table[sh].Region
		offer := slices.DeleteFunc(slices.Clone(view), func(r strategies.Region) bool { return r.ID == from })
		to, err := c.strategy.Allocate(sh, "", offer)
		i := slices.IndexFunc(view, func(r strategies.Region) bool { return r.ID == to })
		if err != nil || i < 0 || view[i].Leaving {
			to = ""
		} else {
			r := &view[i]
			if l, ok := c.load[sh]; ok && len(r.Load) == len(r.Shards) {
				r.Load = append(slices.Clone(r.Load), l)
			}
			r.Shards = append(slices.Clone(r.Shards), sh)
		}
		out[k] = protocol.PlannedMove{Shard: sh, From: from, To: to}
	}
	return out
}

func (c *Core) checkShard(shard int) error {
	if shard < 0 || shard >= c.cfg.Shards {
		return fmt.Errorf("%w: shard %d out of range 0..%d", ErrBadRequest, shard, c.cfg.Shards-1)
	}
	return nil
}
