package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// client is a connection to NATS and to one type's KV bucket.
type client struct {
	opts     options
	nc       *nats.Conn
	js       jetstream.JetStream
	store    *kvstate.Store
	subjects protocol.Subjects
	shards   int
	// history and splittingTo: the type's earlier shard counts, and the
	// count a split under way goes to (its table has that many rows).
	history     []int
	splittingTo int
	durable     bool      // the type's delivery is durable: messages go through its stream
	stderr      io.Writer // for what is not the command's output (watch's banner, --wait's progress)
	denials     *denials
}

func dial(ctx context.Context, o options) (*client, error) {
	subjects, err := protocol.NewSubjects(o.DataPrefix, o.ControlPrefix, o.Type)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errUsage, err)
	}
	opts, err := o.Auth.Options()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errUsage, err)
	}
	denied := newDenials()
	nc, err := nats.Connect(o.NATS, append(opts, nats.Name("shardctl"), nats.Timeout(o.Timeout), nats.MaxReconnects(0), nats.ErrorHandler(denied.handler))...)
	if err != nil {
		hint := "is shardd running? set --nats or NATS_URL"
		switch msg := err.Error(); {
		case strings.Contains(msg, "tls"):
			hint = "the server requires TLS: check --tls-ca (its CA) and --tls-cert/--tls-key (a client certificate it accepts)"
		case errors.Is(err, nats.ErrAuthorization), strings.Contains(msg, "Authorization"), strings.Contains(msg, "authentication"):
			hint = "the server requires credentials: set --creds or NATS_CREDS (shardctl auth)"
		}
		return nil, fmt.Errorf("cannot connect to NATS at %s: %w (%s)", o.NATS, err, hint)
	}
	c := &client{opts: o, nc: nc, subjects: subjects, stderr: io.Discard, denials: denied}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, err
	}
	c.js = js
	octx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	c.store, err = kvstate.Bind(octx, js, o.Type, kvstate.Options{Timeout: o.Timeout})
	if errors.Is(err, kvstate.ErrNotFound) {
		nc.Close()
		return nil, fmt.Errorf("unknown type %q: NATS at %s has no bucket %s (start shardd --type %s first)", o.Type, o.NATS, kvstate.BucketName(o.Type), o.Type)
	}
	if err != nil {
		nc.Close()
		return nil, c.jetStreamErr(err, fmt.Sprintf("open type %q (bucket %s)", o.Type, kvstate.BucketName(o.Type)))
	}
	cfg, err := c.store.Config(octx)
	if err != nil {
		nc.Close()
		return nil, c.jetStreamErr(err, fmt.Sprintf("read the configuration of type %q", o.Type))
	}
	c.shards, c.history, c.splittingTo = cfg.Shards, cfg.History, cfg.To
	c.durable = cfg.DeliveryOf() == protocol.DeliveryDurable
	return c, nil
}

// jetStreamErr explains a failed JetStream operation: a refusal of the
// server, or a timeout, which names what was asked.
func (c *client) jetStreamErr(err error, what string) error {
	if d := c.deniedAfterFlush(); d != nil {
		return d
	}
	if timedOut(err) {
		return fmt.Errorf("%s: JetStream did not answer within %v (is JetStream enabled, and does its cluster have a leader?)", what, c.opts.Timeout)
	}
	return fmt.Errorf("%s: %w", what, err)
}

func (c *client) Close() { c.nc.Close() }

// view is what shardctl knows of a type: the coordinator's answer, or what
// KV holds when no coordinator answers.
type view struct {
	protocol.Status
	// Answered is false when no coordinator answered and the view was
	// read from KV.
	Answered bool
}

func (c *client) view(ctx context.Context) (view, error) {
	st, err := c.askStatus(ctx)
	if err == nil {
		return view{Status: st, Answered: true}, nil
	}
	if d := c.deniedAfterFlush(); d != nil {
		return view{}, d // not a missing coordinator: KV would mislead
	}
	ctx, cancel := context.WithTimeout(ctx, c.opts.Timeout)
	defer cancel()
	v := view{Status: protocol.Status{Type: c.opts.Type, Shards: c.shards, History: c.history, SplittingTo: c.splittingTo}}
	rowsN := max(c.shards, c.splittingTo)
	info, rev, err := c.store.Coordinator(ctx)
	switch {
	case err == nil:
		v.Coordinator = protocol.CoordinatorView{Region: info.Region, Epoch: cmpEpoch(info.Epoch, rev)}
	case !errors.Is(err, kvstate.ErrNotFound):
		return v, c.jetStreamErr(err, "read the coordinator lease")
	}
	rows, err := c.store.Shards(ctx)
	if err != nil {
		return v, c.jetStreamErr(err, "read the shard table")
	}
	pins, err := c.store.Pins(ctx)
	if err != nil {
		return v, c.jetStreamErr(err, "read the pins")
	}
	count := map[string]int{}
	v.Table = make([]protocol.ShardView, rowsN)
	for i := range v.Table {
		v.Table[i] = protocol.ShardView{Shard: i, State: string(protocol.StateUnowned), Pin: pins[i]}
	}
	for _, r := range rows {
		if r.Shard >= 0 && r.Shard < rowsN {
			v.Table[r.Shard] = protocol.ShardView{Shard: r.Shard, Region: r.Region, State: string(r.State), Source: r.Source, Pin: pins[r.Shard]}
			count[r.Region]++
		}
	}
	regions, err := c.store.Regions(ctx)
	if err != nil {
		return v, c.jetStreamErr(err, "read the regions")
	}
	for _, r := range regions {
		v.Regions = append(v.Regions, protocol.RegionView{ID: r.Info.ID, Incarnation: r.Info.Incarnation, Version: r.Info.Version, Leaving: r.Info.Leaving, Shards: count[r.Info.ID]})
	}
	return v, nil
}

func cmpEpoch(stored, rev uint64) uint64 {
	if stored != 0 {
		return stored
	}
	return rev
}

// askStatus asks the coordinator over the admin API.
func (c *client) askStatus(ctx context.Context) (protocol.Status, error) {
	var st protocol.Status
	ctx, cancel := context.WithTimeout(ctx, min(c.opts.Timeout, 2*time.Second))
	defer cancel()
	m, err := c.nc.RequestWithContext(ctx, c.subjects.Admin(protocol.AdminStatus), nil)
	if err != nil {
		return st, err
	}
	if err := json.Unmarshal(m.Data, &st); err != nil {
		return st, fmt.Errorf("coordinator answered garbage: %w", err)
	}
	return st, nil
}
