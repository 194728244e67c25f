package region

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// The registration writes and the table read that the core asks for
// (corereg.go), each in a goroutine of its own that reports back to the
// driver. The core has at most one write in flight.

// register carries out a Register action.
func (a *Agent) register(act Register) {
	a.goDo(func() {
		ev := RegisterDone{Token: act.Token}
		if act.CheckTakeover {
			if err := a.checkNotTakenOver(a.ctx); err != nil {
				ev.Err, ev.At = fmt.Errorf("region: check who holds the registration of %s: %w", a.cfg.ID, err), time.Now()
				a.post(ev)
				return
			}
		}
		info := act.Info
		info.Conn = protocol.ConnIDOf(a.cfg.Conn)
		ev.Sent = time.Now()
		lease, err := a.cfg.Store.RegisterRegion(a.ctx, info, act.TTL)
		ev.Lease, ev.At = lease, time.Now()
		if err != nil {
			ev.Err = fmt.Errorf("region: register %s: %w", a.cfg.ID, err)
		}
		a.post(ev)
	})
}

// renew carries out a Renew action: a compare-and-set of the
// registration at the lease's revision, naming the connection it goes
// over, bounded by the action's deadline.
func (a *Agent) renew(act Renew) {
	a.goDo(func() {
		info, lease := act.Info, act.Lease
		info.Conn = protocol.ConnIDOf(a.cfg.Conn)
		sent := time.Now()
		rctx, cancel := context.WithDeadline(a.ctx, act.Deadline)
		next, err := a.cfg.Store.Renew(rctx, lease, info)
		if errors.Is(err, kvstate.ErrConflict) && rctx.Err() == nil {
			if rev, ok := a.ownLaterRegistration(rctx, lease, info); ok {
				lease.Revision = rev
				next, err = a.cfg.Store.Renew(rctx, lease, info)
			}
		}
		cancel()
		a.post(RenewDone{
			Token: act.Token, Lease: next, Sent: sent, At: time.Now(), Err: err,
			Conflict: errors.Is(err, kvstate.ErrConflict), Canceled: err != nil && a.ctx.Err() != nil,
		})
	})
}

// ownLaterRegistration looks, after a renewal at lease's revision was
// refused, for a registration of this very agent and incarnation stored at
// a later revision: a renewal the server stored after the agent stopped
// waiting for its answer (the connection dropped with its server, or an
// election timed it out). kvstate.Store.Renew finds such a write only when
// it holds exactly the value renewed now, but a region back from a lost
// connection names its new connection (RegionInfo.Conn), so the late
// write differs; fencing then turned a disconnect into a crash (one run in
// about eight of TestServerLossWhileReplaying). Nobody else writes a
// registration naming this agent's instance (the coordinator only
// deletes one, at the revision it read), so such a value is this agent's
// own, and the renewal goes on from its revision.
func (a *Agent) ownLaterRegistration(ctx context.Context, lease kvstate.Lease, info protocol.RegionInfo) (uint64, bool) {
	stored, rev, err := a.cfg.Store.Region(ctx, a.cfg.ID)
	if err != nil || rev <= lease.Revision || stored.Instance != a.instance || stored.Incarnation != info.Incarnation {
		return 0, false
	}
	a.log.Info("a renewal of the registration was stored after its answer was lost; renewing from it", "revision", rev, "was", lease.Revision)
	return rev, true
}

// readTable carries out a ReadTable action: the rows, read after the
// renewal that preceded it, are good only if the connection is still up.
func (a *Agent) readTable(act ReadTable) {
	a.goDo(func() {
		rows, err := a.cfg.Store.Shards(a.ctx)
		switch {
		case err != nil:
			err = fmt.Errorf("read the shard table: %w", err)
		case !a.cfg.Conn.IsConnected():
			err = errors.New("the connection dropped again meanwhile")
		}
		a.post(Confirmed{Incarnation: act.Incarnation, Drops: act.Drops, Rows: rows, Err: err})
	})
}
