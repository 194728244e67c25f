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
	return c.change(ctx, out, protocol.AdminMove, protocol.MoveRequest{Shard: shard, Region: region}, fmt.Sprintf("moving shard %d to %s", shard, region), moveGoal(shard, region))
}

func cmdDrain(ctx context.Context, c *client, args []string, out io.Writer) error {
	region, err := parseRegion(args[0])
	if err != nil {
		return err
	}
	return c.change(ctx, out, protocol.AdminDrain, protocol.DrainRequest{Region: region}, fmt.Sprintf("draining %s: its shards are being handed off", region), drainGoal(region))
}

func cmdUndrain(ctx context.Context, c *client, args []string, out io.Writer) error {
	region, err := parseRegion(args[0])
	if err != nil {
		return err
	}
	return c.change(ctx, out, protocol.AdminUndrain, protocol.UndrainRequest{Region: region}, fmt.Sprintf("undraining %s", region), undrainGoal(region))
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

// changeJSON is the --json answer of move, drain, undrain, pin and unpin.
type changeJSON struct {
	OK      bool   `json:"ok"`
	Message string `json:"message"`
	Note    string `json:"note,omitempty"`
	// Done says what --wait waited for, once it is so.
	Done string `json:"done,omitempty"`
}

// change sends an admin request that changes something and prints done,
// with the coordinator's note about what follows. With --wait and a goal,
// it then follows the change until the goal is reached (wait.go).
func (c *client) change(ctx context.Context, out io.Writer, verb string, req any, done string, g *goal) error {
	var w *waiter
	if g != nil {
		var err error
		if w, err = c.startWait(); err != nil {
			return err
		}
		defer w.stop()
	}
	var ans protocol.AdminOK
	if err := c.admin(ctx, verb, req, &ans); err != nil {
		return err
	}
	res := changeJSON{OK: true, Message: done, Note: ans.Note}
	if !c.opts.JSON {
		say(out, "%s\n", done)
		if ans.Note != "" {
			say(out, "%s\n", ans.Note)
		}
	}
	if w != nil {
		var err error
		if res.Done, err = w.until(ctx, g); err != nil {
			return err
		}
		if !c.opts.JSON {
			say(out, "%s\n", res.Done)
		}
	}
	if c.opts.JSON {
		return writeJSON(out, res)
	}
	return nil
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
	subject := c.subjects.Admin(verb)
	noCoordinator := func() error {
		if d := c.deniedAfterFlush(); d != nil {
			return d
		}
		return fmt.Errorf("no coordinator of type %q is running (no responders on %s within %v)", c.opts.Type, subject, c.opts.Timeout)
	}
	var m *nats.Msg
	waited := false
	for {
		m, err = c.nc.RequestWithContext(ctx, subject, data)
		if !errors.Is(err, nats.ErrNoResponders) {
			break
		}
		waited = true
		select {
		case <-ctx.Done():
			return noCoordinator()
		case <-time.After(100 * time.Millisecond):
		}
	}
	if err != nil && waited && ctx.Err() != nil {
		return noCoordinator()
	}
	if err != nil {
		return c.noAnswer(err, "the coordinator to "+verb, subject)
	}
	var res protocol.AdminError
	if err := json.Unmarshal(m.Data, &res); err != nil {
		return fmt.Errorf("%s: coordinator answered garbage: %w", verb, err)
	}
	if res.Error != "" {
		return &refusal{verb: verb, AdminError: res}
	}
	if ans != nil {
		if err := json.Unmarshal(m.Data, ans); err != nil {
			return fmt.Errorf("%s: coordinator answered garbage: %w", verb, err)
		}
	}
	return nil
}

// refusal is an admin request the coordinator refused; Retry says that it
// may be taken later (protocol.AdminError).
type refusal struct {
	verb string
	protocol.AdminError
}

func (r *refusal) Error() string { return fmt.Sprintf("%s refused: %s", r.verb, r.AdminError.Error) }
