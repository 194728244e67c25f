package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

func cmdMove(ctx context.Context, c *client, args []string, out io.Writer) error {
	shard, region, err := c.parseShardRegion(args)
	if err != nil {
		return err
	}
	return c.change(ctx, out, protocol.AdminMove, protocol.MoveRequest{Shard: shard, Region: region}, fmt.Sprintf("moving shard %d to %s", shard, region))
}

func cmdDrain(ctx context.Context, c *client, args []string, out io.Writer) error {
	region, err := parseRegion(args[0])
	if err != nil {
		return err
	}
	return c.change(ctx, out, protocol.AdminDrain, protocol.DrainRequest{Region: region}, fmt.Sprintf("draining %s: its shards are being handed off", region))
}

func (c *client) parseShard(arg string) (int, error) {
	shard, err := strconv.Atoi(arg)
	if err != nil || shard < 0 || shard >= c.shards {
		return 0, fmt.Errorf("%w: shard %q is not a number in 0..%d", errUsage, arg, c.shards-1)
	}
	return shard, nil
}

// parseShardRegion parses the <shard> <region> arguments of move and pin.
func (c *client) parseShardRegion(args []string) (int, string, error) {
	shard, err := c.parseShard(args[0])
	if err != nil {
		return 0, "", err
	}
	region, err := parseRegion(args[1])
	return shard, region, err
}

func parseRegion(arg string) (string, error) {
	if err := protocol.ValidateName("region", arg); err != nil {
		return "", fmt.Errorf("%w: %w", errUsage, err)
	}
	return arg, nil
}

// change sends an admin request that changes something and prints done,
// with the coordinator's note about what follows.
func (c *client) change(ctx context.Context, out io.Writer, verb string, req any, done string) error {
	var ans protocol.AdminOK
	if err := c.admin(ctx, verb, req, &ans); err != nil {
		return err
	}
	msg, note := done, ans.Note
	if c.opts.JSON {
		return writeJSON(out, struct {
			OK      bool   `json:"ok"`
			Message string `json:"message"`
			Note    string `json:"note,omitempty"`
		}{true, msg, note})
	}
	if note != "" {
		msg += "\n" + note
	}
	_, err := fmt.Fprintln(out, msg)
	return err
}

// admin sends an admin request to the coordinator and decodes its answer
// into ans (unless nil); an error answer is returned as an error. While
// no coordinator listens (a failover or a graceful handover in progress)
// it asks again, within --timeout.
func (c *client) admin(ctx context.Context, verb string, req, ans any) error {
	data, err := json.Marshal(req)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, c.opts.Timeout)
	defer cancel()
	noCoordinator := fmt.Errorf("no coordinator of type %q is running (no responders on %s within %v)", c.opts.Type, c.subjects.Admin(verb), c.opts.Timeout)
	var m *nats.Msg
	waited := false
	for {
		m, err = c.nc.RequestWithContext(ctx, c.subjects.Admin(verb), data)
		if !errors.Is(err, nats.ErrNoResponders) {
			break
		}
		waited = true
		select {
		case <-ctx.Done():
			return noCoordinator
		case <-time.After(100 * time.Millisecond):
		}
	}
	if err != nil && waited && ctx.Err() != nil {
		return noCoordinator
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
	if ans != nil {
		if err := json.Unmarshal(m.Data, ans); err != nil {
			return fmt.Errorf("%s: coordinator answered garbage: %w", verb, err)
		}
	}
	return nil
}
