package main

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"sync"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/auth"
)

// Errors name their cause: what the server refused and the role it takes
// (denials), and what a timeout waited for (noAnswer).

// denials records the permissions violations the server reports on a
// connection. The server refuses a publish or a subscription with an
// asynchronous -ERR, so a refused request only times out: the refusal
// recorded here is the error to report.
type denials struct {
	mu    sync.Mutex
	first error
	seen  chan struct{} // closed at the first
}

func newDenials() *denials { return &denials{seen: make(chan struct{})} }

// handler is the connection's asynchronous error handler.
func (d *denials) handler(_ *nats.Conn, _ *nats.Subscription, err error) {
	if !errors.Is(err, nats.ErrPermissionViolation) {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.first == nil {
		d.first = err
		close(d.seen)
	}
}

func (d *denials) get() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.first
}

// violationRe reads the server's refusal: Permissions Violation for
// Publish to "$SHARD.kv.admin.move" (or Subscription to ...).
var violationRe = regexp.MustCompile(`(Publish|Subscription) to "([^"]*)"`)

// permissionError names what the server refused and the role the command
// needs, and says which credentials were used.
func permissionError(violation error, o options) error {
	what := "an operation"
	if m := violationRe.FindStringSubmatch(violation.Error()); m != nil {
		verb := map[string]string{"Publish": "publish to", "Subscription": "subscribe to"}[m[1]]
		what = fmt.Sprintf("%s %q", verb, m[2])
	}
	// Every command reads the type's KV bucket (its shard count), which
	// only the admin role may.
	var who string
	switch name, role, err := auth.User(o.Auth.Creds); {
	case o.Auth.Creds == "":
		who = "no credentials were given (--creds, NATS_CREDS); the server's own users lack the permission"
	case err != nil:
		who = err.Error()
	case role == "":
		who = fmt.Sprintf("the user %q of %s has no natshard role: give it the permissions of the admin role (docs/SECURITY.md)", name, o.Auth.Creds)
	case role == auth.Admin:
		who = fmt.Sprintf("the user %q of %s has the %s role, but not for type %q with these subject prefixes: make admin credentials for it with shardctl auth user admin <name> --types %s", name, o.Auth.Creds, role, o.Type, o.Type)
	default:
		who = fmt.Sprintf("the user %q of %s has the %s role: use admin credentials (shardctl auth user admin <name> --types %s)", name, o.Auth.Creds, role, o.Type)
	}
	return fmt.Errorf("permission denied: the NATS server refused to let this user %s: shardctl %s needs the admin role for type %q; %s", what, o.Command, o.Type, who)
}

// timedOut reports whether err is a timeout of NATS or of a context.
func timedOut(err error) bool {
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout)
}

// noAnswer explains err from a request for what on subject: a refusal of
// the server, a timeout naming what it waited for, or err itself.
func (c *client) noAnswer(err error, what, subject string) error {
	if d := c.denied(); d != nil {
		return d
	}
	if timedOut(err) {
		return fmt.Errorf("no answer from %s within %v (request on %s)", what, c.opts.Timeout, subject)
	}
	return fmt.Errorf("%s (request on %s): %w", what, subject, err)
}

// denied returns the permission error if the server refused something on
// this connection so far.
func (c *client) denied() error {
	if v := c.denials.get(); v != nil {
		return permissionError(v, c.opts)
	}
	return nil
}

// deniedAfterFlush is denied once the server has answered everything
// sent, so that a refusal of the last publish is known.
func (c *client) deniedAfterFlush() error {
	if !c.nc.IsClosed() {
		_ = c.nc.FlushTimeout(c.opts.Timeout)
	}
	return c.denied()
}
