package main

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
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
	m := c.keyed(&nats.Msg{Subject: subject, Data: []byte(args[1])})
	if err := c.nc.PublishMsg(m); err != nil {
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
	if c.durable {
		return c.requestDurable(ctx, args[0], []byte(args[1]), out)
	}
	m, err := c.nc.RequestMsgWithContext(ctx, c.keyed(&nats.Msg{Subject: subject, Data: []byte(args[1])}))
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
		if code := m.Header.Get(protocol.HeaderErrorCode); code != "" {
			return fmt.Errorf("entity answered with an error: %s (code %s)", e, code)
		}
		return fmt.Errorf("entity answered with an error: %s", e)
	}
	return nil
}

// requestDurable sends a request to entity id of a type of durable
// delivery as natshard's Client does: through the type's stream, with an
// inbox in Natshard-Reply where the entity answers (a core request would
// be answered by the stream's acknowledgement, not by the entity). It
// prints the entity's answer as cmdRequest does.
func (c *client) requestDurable(ctx context.Context, id string, data []byte, out io.Writer) error {
	nc := natshard.NewClient(c.nc, natshard.WithPrefix(c.opts.DataPrefix), natshard.WithTimeout(c.opts.Timeout))
	var opts []natshard.SendOption
	if c.opts.Key != "" {
		opts = append(opts, natshard.MsgID(c.opts.Key))
	}
	answer, err := nc.Request(ctx, c.opts.Type, id, data, opts...)
	var ee *natshard.EntityError
	switch {
	case errors.As(err, &ee):
		fmt.Fprintln(out, cleanText(string(ee.Data)))
		if ee.Code != "" {
			return fmt.Errorf("entity answered with an error: %s (code %s)", ee.Message, ee.Code)
		}
		return fmt.Errorf("entity answered with an error: %s", ee.Message)
	case err != nil:
		if d := c.deniedAfterFlush(); d != nil {
			return d
		}
		return fmt.Errorf("request to entity %s through the stream of type %q: %w", id, c.opts.Type, err)
	}
	fmt.Fprintln(out, cleanText(string(answer)))
	return nil
}

// keyed gives m the idempotency key of --key, if set.
func (c *client) keyed(m *nats.Msg) *nats.Msg {
	if c.opts.Key != "" {
		m.Header = nats.Header{protocol.HeaderMsgID: {c.opts.Key}}
	}
	return m
}
