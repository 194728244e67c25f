package natshard

import (
	"errors"
	"fmt"
	"time"
)

// DefaultReadyAfter is the default of Options.ReadyAfter.
const DefaultReadyAfter = 10 * time.Second

// Healthy reports whether the node is alive: it was not stopped and has
// not failed, and its NATS connection is up. It returns nil when healthy,
// else an error wrapping ErrUnhealthy that says why. A node whose
// connection is reconnecting is unhealthy: a liveness probe should allow
// it some time (nats.go reconnects every 500 ms).
func (n *Node) Healthy() error {
	select {
	case <-n.done:
		if err := n.Err(); err != nil {
			return fmt.Errorf("%w: the node failed: %w", ErrUnhealthy, err)
		}
		return fmt.Errorf("%w: the node stopped", ErrUnhealthy)
	default:
	}
	if !n.nc.IsConnected() {
		return fmt.Errorf("%w: not connected to NATS (%s)", ErrUnhealthy, n.nc.Status())
	}
	return nil
}

// Ready reports whether the node serves its types: nil when ready, else
// an error wrapping ErrNotReady that says, per type, what it waits for.
// The package doc's "Health" says what it checks (docs/OPERATIONS.md,
// "Health", what /readyz answers); a node that is stopping (Stop, Close,
// or Run's context ended) is not ready.
func (n *Node) Ready() error {
	select {
	case <-n.stopping:
		return fmt.Errorf("%w: the node is stopping", ErrNotReady)
	default:
	}
	if err := n.Healthy(); err != nil {
		return fmt.Errorf("%w: %w", ErrNotReady, err)
	}
	if err := n.jetStreamCurrent(); err != nil {
		return fmt.Errorf("%w: %w", ErrNotReady, err)
	}
	waiting := n.opts.ReadyAfter < 0 || time.Since(n.started) < n.opts.ReadyAfter
	var errs []error
	for _, h := range n.hostedTypes() {
		if h.agent == nil {
			continue // a dedicated coordinator candidate: connected is ready
		}
		st := h.agent.Status()
		switch {
		case st.Closed:
			errs = append(errs, fmt.Errorf("type %q: the region is closed", h.t.Name))
			continue
		case !st.Registered:
			errs = append(errs, fmt.Errorf("type %q: the region is fenced, registering again", h.t.Name))
			continue
		case h.settled.Load() || !waiting:
			continue
		case st.Epoch == 0:
			errs = append(errs, fmt.Errorf("type %q: no coordinator has taken the region in yet%s", h.t.Name, n.readyAnyway()))
		case st.Replaying > 0:
			errs = append(errs, fmt.Errorf("type %q: replaying the buffers of %d shards", h.t.Name, st.Replaying))
		default:
			h.settled.Store(true)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("%w: %w", ErrNotReady, err)
	}
	return nil
}

// readyAnyway says when Ready stops waiting, for its errors.
func (n *Node) readyAnyway() string {
	if n.opts.ReadyAfter < 0 {
		return ""
	}
	return fmt.Sprintf(" (ready anyway %s after the start)", n.opts.ReadyAfter)
}
