package main

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

func (c *client) entitySubject(id string) (string, error) {
	if err := protocol.ValidateEntityID(id); err != nil {
		return "", fmt.Errorf("%w: %w", errUsage, err)
	}
	return c.subjects.EntityOf(id, c.shards), nil
}

func cmdSend(_ context.Context, c *client, args []string, out io.Writer) error {
	subject, err := c.entitySubject(args[0])
	if err != nil {
		return err
	}
	if err := c.nc.Publish(subject, []byte(args[1])); err != nil {
		return fmt.Errorf("publish to %s: %w", subject, err)
	}
	if err := c.nc.FlushTimeout(c.opts.Timeout); err != nil {
		return c.noAnswer(err, "the server to a flush after the publish", subject)
	}
	if d := c.denied(); d != nil {
		return d
	}
	if c.opts.JSON {
		return writeJSON(out, map[string]any{"subject": subject, "sent": true})
	}
	say(out, "sent to %s\n", subject)
	return nil
}

func cmdRequest(ctx context.Context, c *client, args []string, out io.Writer) error {
	subject, err := c.entitySubject(args[0])
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, c.opts.Timeout)
	defer cancel()
	m, err := c.nc.RequestWithContext(ctx, subject, []byte(args[1]))
	if errors.Is(err, nats.ErrNoResponders) {
		if d := c.deniedAfterFlush(); d != nil {
			return d
		}
		return fmt.Errorf("no region serves shard %d of type %q right now (no responders on %s)", protocol.ShardOf(args[0], c.shards), c.opts.Type, subject)
	}
	if err != nil {
		return c.noAnswer(err, "entity "+args[0], subject)
	}
	// The answer is the entity's, printed as it is but for control
	// characters (output.go).
	fmt.Fprintln(out, cleanText(string(m.Data)))
	if e := m.Header.Get(protocol.HeaderError); e != "" {
		return fmt.Errorf("entity answered with an error: %s", e)
	}
	return nil
}
