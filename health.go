package natshard

import (
	"errors"
	"fmt"
	"time"
)

// Health. Healthy is the liveness of a node, Ready its readiness, on the
// model of Akka's sharding health check: ready once each type's region is
// registered and the coordinator has taken it in (it commanded it) with
// no shard left to replay; once that was true it stays true (a
// coordinator failover or a move does not make every node unready), and
// after Options.ReadyAfter since the start it is not waited for any more
// (Akka's disabled-after), so that a rolling update cannot stall on a
// coordinator that does not come. What is always checked: the node
// serves (not stopping, not failed), its connection is up and each region
// is registered: a fenced region serves nothing until it registers again;
// and a member of an embedded cluster is ready only while its server's
// JetStream is current with the cluster (nats-server's /healthz: its meta
// group and its replicas caught up), so that a rolling restart that waits
// for each member's readiness never takes down a second replica before the
// first one caught up.
// package web serves both on /healthz and /readyz.

// DefaultReadyAfter is the default of Options.ReadyAfter.
const DefaultReadyAfter = 10 * time.Second

// Errors of Healthy and Ready.
var (
	// ErrNotReady wraps why Ready found the node not ready.
	ErrNotReady = errors.New("natshard: not ready")
	// ErrUnhealthy wraps why Healthy found the node unhealthy.
	ErrUnhealthy = errors.New("natshard: unhealthy")
)

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
// See the package's health model above; a node that is stopping (Stop,
// Close, or Run's context ended) is not ready.
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
