package natshard

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/natshard/natshard/kvstate"
)

// This file holds how a node stops: gracefully (its regions leave first)
// or fast, in the order that loses nothing, and how it reports the end.

// Stop stops the node gracefully: every type's region leaves (its shards
// are handed off to the other processes, nothing is lost), until ctx ends;
// shards still held then are re-homed by the coordinator as after a crash.
// Then, whatever ctx, for at most 20 seconds: the regions stop their
// entities (running their Stop hooks) and deregister, the coordinators
// release their leases, the connection drains (unless it is the
// caller's), the embedded server stops. It returns ErrClosed when the
// node was stopped already.
func (n *Node) Stop(ctx context.Context) error { return n.shutdown(ctx, true) }

// Close stops the node without handing its shards off first: as Stop
// after a leave that ended at once. The coordinator re-homes the shards as
// after a crash (at once, as the regions deregister), and messages sent to
// them meanwhile are lost.
func (n *Node) Close(ctx context.Context) error { return n.shutdown(ctx, false) }

func (n *Node) shutdown(ctx context.Context, leave bool) error {
	first := false
	n.stopOnce.Do(func() { first = true })
	if !first {
		<-n.stopped
		return ErrClosed
	}
	defer close(n.stopped)
	close(n.stopping)
	types := n.hostedTypes()
	for _, h := range types {
		if h.daemon != nil {
			h.daemon.end() // no more keep-alives: the workers stop with the region
		}
	}
	if leave {
		n.log.Info("stopping: leaving, waiting for the shards to be handed off")
		var wg sync.WaitGroup
		for _, h := range types {
			if h.agent != nil {
				wg.Go(func() { h.leave(ctx) })
			}
		}
		wg.Wait()
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), closeTimeout)
	defer cancel()
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	for _, h := range types {
		if h.agent == nil {
			continue
		}
		wg.Go(func() {
			if err := h.agent.Close(cctx); err != nil {
				mu.Lock()
				errs = append(errs, fmt.Errorf("natshard: type %q: %w", h.t.Name, err))
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	for _, h := range types {
		h.stopCoordinator()
	}
	for _, h := range types {
		<-h.coordinatorDone
	}
	n.nc.RemoveStatusListener(n.status)
	<-n.watchDone
	if n.ownsSys {
		n.sys.Close()
	}
	n.closeConn()
	n.shutdownServer()
	n.unregisterMetrics()
	n.finish(nil)
	n.log.Info("natshard node stopped", "region", n.opts.Region)
	return errors.Join(errs...)
}

// leave hands h's shards off, unless nobody can take them.
func (h *hosted) leave(ctx context.Context) {
	lctx, cancel := context.WithTimeout(ctx, LeaveTimeout)
	defer cancel()
	switch _, _, err := h.store.Coordinator(lctx); {
	case !h.node.nc.IsConnected():
		h.log.Warn("not connected to NATS: the shards are not handed off", "shards", len(h.agent.Held()))
	case errors.Is(err, kvstate.ErrNotFound):
		h.log.Warn("no coordinator is running: the shards are not handed off; messages sent to them are lost until a coordinator re-homes them", "shards", len(h.agent.Held()))
	default:
		if err := h.agent.Leave(lctx); err != nil {
			h.log.Warn("shards not all handed off in time; the coordinator re-homes the rest as after a crash", "err", err, "shards", h.agent.Held())
		}
	}
}

// closeConn drains a connection the node made (waiting for it to close
// for at most closeTimeout), and leaves the caller's alone.
func (n *Node) closeConn() {
	if !n.ownsConn {
		return
	}
	if err := n.nc.Drain(); err != nil {
		n.log.Warn("drain", "err", err)
	}
	deadline := time.Now().Add(closeTimeout)
	for !n.nc.IsClosed() && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	n.nc.Close()
}

// unregisterMetrics removes the node's collectors from Options.Metrics.
func (n *Node) unregisterMetrics() {
	if n.metrics != nil {
		n.metrics.unregister()
	}
}

// shutdownServer stops the embedded server. A cluster member first hands
// the leadership of its JetStream assets to the other members and closes
// its clients (they reconnect to the others), in lameDuck: nats-server's
// lame duck mode.
func (n *Node) shutdownServer() {
	if n.srv == nil {
		return
	}
	if n.opts.Server.clustered() {
		n.srv.LameDuckShutdown()
	}
	n.srv.Shutdown()
	n.srv.WaitForShutdown()
}

// finish closes Done, with err as the reason (nil for a stop).
func (n *Node) finish(err error) {
	n.doneOnce.Do(func() {
		n.failErr = err
		close(n.done)
		if err != nil {
			n.log.Error("natshard node failed; stop it", "err", err)
		}
	})
}
