package natshard

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/kvstate"
)

// Start-up that waits. What a node needs from JetStream at start (each
// type's KV bucket, its stored configuration, its buffer and message
// streams, the region's first registration) is retried while JetStream is
// only unavailable: a cluster still forming or electing its meta leader,
// a stream electing its leader, a server whose JetStream is not enabled
// yet, an attempt that got no answer in time. Each attempt is bounded by
// startAttempt; the attempts back off from wait.RetryFirst to
// wait.RetryMax; the wait is logged at INFO every startLogEvery and told
// to Options.OnStartWait; it ends with ErrStartTimeout after
// Options.StartTimeout (counted from Start's call), or at once when Start's
// context ends. What waiting cannot cure fails at once: a configuration
// that disagrees with the stored one, a region id in use, a store too
// small (kvstate.ErrNoSpace), a permission the connection lacks.

// DefaultStartTimeout is the default of Options.StartTimeout: a few
// minutes, so that a process started with (or just before) a fresh
// cluster outlasts the cluster's forming, several meta leader elections
// (seconds each) and the restart of a server, while one pointed at a
// cluster that will not come fails, saying why, while its operator still
// watches (a process manager then restarts it).
const DefaultStartTimeout = 2 * time.Minute

// StartWait is what Start waits for (Options.OnStartWait).
type StartWait struct {
	// Type whose state is waited for.
	Type string
	// What is waited for, as in the logs: "its KV bucket natshard_orders"
	// and so on.
	What string
	// Since when it is waited for.
	Since time.Time
	// Attempts made so far, and the last one's error.
	Attempts int
	Err      error
}

// Waiting reports whether w says that Start waits (the zero StartWait
// says it does not).
func (w StartWait) Waiting() bool { return w.What != "" }

func (w StartWait) String() string {
	if !w.Waiting() {
		return "not waiting"
	}
	return fmt.Sprintf("type %q: waiting %s for %s: %s (%d attempts; last: %v)",
		w.Type, time.Since(w.Since).Round(time.Second), w.What, jetStreamWhy(w.Err), w.Attempts, w.Err)
}

const (
	// startAttempt bounds one attempt of an open, of a lookup of the stored
	// configuration, of the first registration.
	startAttempt = 10 * time.Second
	// startLogEvery: the wait is logged no more often.
	startLogEvery = 5 * time.Second
)

// untilAvailable runs op (with an attempt's context) until it succeeds,
// fails with an error that waiting cannot cure (returned as it is), the
// start timeout passes (ErrStartTimeout) or ctx ends. what names what op
// opens, for the logs and the errors.
func (h *hosted) untilAvailable(ctx context.Context, what string, op func(context.Context) error) error {
	n := h.node
	var (
		since   = time.Now() // the first attempt's start
		waited  bool         // an attempt failed
		logged  time.Time
		backoff = wait.RetryFirst
		lastErr = n.nc.LastError()
	)
	defer func() {
		if waited {
			n.reportWait(StartWait{}) // over, whatever the outcome
		}
	}()
	for attempt := 1; ; attempt++ {
		deadline := time.Now().Add(startAttempt)
		if deadline.After(n.startDeadline) {
			deadline = n.startDeadline
		}
		actx, cancel := context.WithDeadline(ctx, deadline)
		err := op(actx)
		cancel()
		if err == nil {
			if waited {
				h.log.Info("JetStream available: done waiting", "for", what, "waited", time.Since(since).Round(time.Millisecond).String(), "attempts", attempt)
			}
			return nil
		}
		if e := n.nc.LastError(); e != lastErr && deniedJetStream(e) {
			return fmt.Errorf("%w (the connection is denied JetStream's API: %v)", err, e)
		}
		if !waitable(err) {
			return err
		}
		now := time.Now()
		waited = true
		if ctx.Err() != nil {
			return fmt.Errorf("start cancelled while waiting %s for %s: %w (last attempt: %w)", now.Sub(since).Round(time.Millisecond), what, context.Cause(ctx), err)
		}
		if !now.Before(n.startDeadline) {
			return fmt.Errorf("%w %s (Options.StartTimeout; shardd --start-timeout) passed: waited %s for %s, JetStream stayed unavailable: %s: %w",
				ErrStartTimeout, n.opts.StartTimeout, now.Sub(since).Round(time.Second), what, jetStreamWhy(err), err)
		}
		w := StartWait{Type: h.t.Name, What: what, Since: since, Attempts: attempt, Err: err}
		n.reportWait(w)
		if now.Sub(logged) >= startLogEvery {
			logged = now
			h.log.Info("waiting for JetStream", "for", what, "waited", now.Sub(since).Round(time.Second).String(),
				"why", jetStreamWhy(err), "attempts", attempt, "gives_up_in", n.startDeadline.Sub(now).Round(time.Second).String(), "err", err)
		}
		if !wait.Sleep(ctx, min(backoff, time.Until(n.startDeadline))) {
			return fmt.Errorf("start cancelled while waiting %s for %s: %w (last attempt: %w)", time.Since(since).Round(time.Millisecond), what, context.Cause(ctx), err)
		}
		backoff = wait.Next(backoff)
	}
}

// reportWait tells Options.OnStartWait.
func (n *Node) reportWait(w StartWait) {
	if n.opts.OnStartWait != nil {
		n.opts.OnStartWait(w)
	}
}

// waitable reports whether err only says that JetStream is unavailable
// for now. A lack of space is unavailable too for a write, but not for an
// open: the store cannot reserve the stream's bytes (a configuration to
// change).
func waitable(err error) bool {
	return errors.Is(err, kvstate.ErrUnavailable) && !errors.Is(err, kvstate.ErrNoSpace)
}

// deniedJetStream reports a permissions violation on JetStream's API: the
// server refuses the request and the client only times out, with the
// violation as the connection's last error.
func deniedJetStream(err error) bool {
	return errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), "$JS.")
}

// jetStreamWhy says in words what an unavailable JetStream's error means.
func jetStreamWhy(err error) string {
	switch {
	case err == nil:
		return "no error"
	case errors.Is(err, jetstream.ErrJetStreamNotEnabledForAccount), errors.Is(err, nats.ErrJetStreamNotEnabledForAccount):
		return "JetStream is not enabled for this account (yet: if it stays so, the account has no JetStream)"
	case errors.Is(err, jetstream.ErrJetStreamNotEnabled), errors.Is(err, nats.ErrJetStreamNotEnabled), errors.Is(err, nats.ErrNoResponders):
		return "JetStream is not enabled on the server (yet: it may be starting)"
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, nats.ErrTimeout):
		return "JetStream did not answer in time (its server starting, or no meta leader: a cluster forming or electing one)"
	case errors.Is(err, nats.ErrConnectionReconnecting), errors.Is(err, nats.ErrDisconnected), errors.Is(err, nats.ErrConnectionClosed), errors.Is(err, nats.ErrNoServers):
		return "not connected to NATS"
	}
	var api *jetstream.APIError
	if errors.As(err, &api) && api.Code == 503 {
		return "JetStream is not available (no leader: the cluster, or the stream's replicas, electing one)"
	}
	return "JetStream is unavailable"
}
