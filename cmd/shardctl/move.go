package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

func cmdMove(ctx context.Context, c *client, args []string, out io.Writer) error {
	shard, err := strconv.Atoi(args[0])
	if err != nil || shard < 0 || shard >= c.shards {
		return fmt.Errorf("%w: shard %q is not a number in 0..%d", errUsage, args[0], c.shards-1)
	}
	if err := protocol.ValidateName("region", args[1]); err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	if err := c.admin(ctx, protocol.AdminMove, protocol.MoveRequest{Shard: shard, Region: args[1]}); err != nil {
		return err
	}
	return c.report(out, fmt.Sprintf("moving shard %d to %s", shard, args[1]))
}

func cmdDrain(ctx context.Context, c *client, args []string, out io.Writer) error {
	if err := protocol.ValidateName("region", args[0]); err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	if err := c.admin(ctx, protocol.AdminDrain, protocol.DrainRequest{Region: args[0]}); err != nil {
		return err
	}
	return c.report(out, fmt.Sprintf("draining %s: its shards are being handed off", args[0]))
}

func (c *client) report(out io.Writer, msg string) error {
	if c.opts.JSON {
		return writeJSON(out, map[string]any{"ok": true, "message": msg})
	}
	_, err := fmt.Fprintln(out, msg)
	return err
}

// admin sends an admin request to the coordinator and returns its error.
func (c *client) admin(ctx context.Context, verb string, req any) error {
	data, err := json.Marshal(req)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, c.opts.Timeout)
	defer cancel()
	m, err := c.nc.RequestWithContext(ctx, c.subjects.Admin(verb), data)
	if errors.Is(err, nats.ErrNoResponders) {
		return fmt.Errorf("no coordinator of type %q is running (no responders on %s)", c.opts.Type, c.subjects.Admin(verb))
	}
	if err != nil {
		return fmt.Errorf("%s: %w", verb, err)
	}
	var res protocol.AdminError
	if err := json.Unmarshal(m.Data, &res); err != nil {
		return fmt.Errorf("%s: coordinator answered garbage: %w", verb, err)
	}
	if res.Error != "" {
		return fmt.Errorf("%s refused: %s", verb, res.Error)
	}
	return nil
}
