package coordinator

import (
	"bytes"
	"fmt"
	"maps"

	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/strategies"
)

// This file holds the operators' requests that change what the strategy
// decides: pins, rebalance rounds on demand and undrain (shardctl pin,
// unpin, rebalance, undrain), and the admin API's decoding of every
// request but status. Move and Drain are in core.go.

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
	case protocol.AdminUndrain:
		var req protocol.UndrainRequest
		if err = protocol.DecodeJSON(data, &req); err == nil {
			acts, note, err = c.Undrain(req.Region)
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
	case protocol.AdminReshard:
		var req protocol.ReshardRequest
		if err = protocol.DecodeJSON(data, &req); err == nil {
			acts, note, err = c.Reshard(req.Shards)
		}
	default:
		err = fmt.Errorf("unknown admin verb %q (verbs: status, move, drain, undrain, pin, unpin, rebalance, reshard)", verb)
	}
	if err != nil {
		return nil, nil, err
	}
	return protocol.AdminOK{OK: true, Note: note}, acts, nil
}

// Undrain lets a drained region take shards again: the region clears its
// leaving mark, and allocations and rebalance rounds count it again once
// its registration says so. It is refused while the table gives the region
// a shard (as owner or as the source of a move): a leaving region that
// holds shards is being drained, or its process is stopping (SIGTERM marks
// it leaving too), and the coordinator cannot tell which; a stopping
// process exits as soon as it holds none. The region checks the same when
// it obeys. Undraining a region that is not leaving does nothing.
func (c *Core) Undrain(region string) (acts []Action, note string, err error) {
	if err := protocol.ValidateName("region id", region); err != nil {
		return nil, "", fmt.Errorf("%w: %w", ErrBadRequest, err)
	}
	r, ok := c.regions[region]
	if !ok {
		return nil, "", fmt.Errorf("%w: %q", ErrUnknownRegion, region)
	}
	if !r.Info.Leaving {
		return nil, fmt.Sprintf("region %s is not leaving", region), nil
	}
	held := 0
	for _, rec := range c.table {
		owner := rec.Region == region && rec.Incarnation == r.Info.Incarnation
		source := rec.Source == region && rec.SourceIncarnation == r.Info.Incarnation
		if owner || source {
			held++
		}
	}
	if held > 0 {
		shards := "shards"
		if held == 1 {
			shards = "shard"
		}
		return nil, "", fmt.Errorf("%w: region %s still holds %d %s: it is being drained, or its process is stopping; undrain it once it holds none (shardctl drain %s --wait)",
			ErrRegionBusy, region, held, shards, region)
	}
	c.send(r, protocol.CmdUndrain, nil, nil)
	return c.flush(), fmt.Sprintf("region %s takes shards again once its registration says so; rebalance rounds move shards to it", region), nil
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
	c.dropPlan("pins changed")
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
	c.dropPlan("pins changed")
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
// most do nothing while shards are in progress, and no round starts while
// another is open). It returns the moves with the region the strategy
// would place each shard on now, and, unless dryRun, makes them the plan
// of a new round, whose moves start as the bound on moves in flight
// allows (each shard goes where the plan placed it, if that region can
// still take it). The periodic round counts from now.
func (c *Core) Rebalance(dryRun bool) (protocol.RebalanceAnswer, []Action) {
	moves, busy := c.round()
	planned := c.plan(moves)
	ans := protocol.RebalanceAnswer{DryRun: dryRun, Moves: planned, InProgress: busy}
	if dryRun {
		return ans, nil
	}
	c.lastRound, c.rounds.flux, c.rounds.follow = c.tick, false, false
	c.startRound(planned, busy)
	return ans, c.flush()
}

func (c *Core) checkShard(shard int) error {
	if shard < 0 || shard >= len(c.table) {
		return fmt.Errorf("%w: shard %d out of range 0..%d", ErrBadRequest, shard, len(c.table)-1)
	}
	return nil
}
