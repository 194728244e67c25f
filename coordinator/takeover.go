package coordinator

import (
	"context"
	"errors"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nuid"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// This file is the candidate's side of a coordinator failover: waiting for
// the lease, and taking it from a holder whose connection is gone without
// waiting for the lease to expire (PROTOCOL.md, Coordinator failover).
//
// Every candidate answers on a subject of its own, Subjects.Coordinator(id),
// for as long as it runs, and writes id into the lease when it takes it
// (CoordinatorInfo.Probe). The others probe that subject. "No responders"
// proves that the servers know no subscription there: the holder's
// connection is closed (its process died, or the server dropped it). It
// does not prove that the process is dead: a holder whose connection
// dropped reconnects, and its subscriptions come back with it. So a
// candidate deposes the holder only after HolderSilence of nothing but "no
// responders", probe after probe (any answer, or any other outcome, starts
// over), or at the first "no responders" after a server reported that the
// holder's client closed or reset its connection (a disconnect advisory: the
// process died), and only by a compare-and-delete at the lease revision it read
// when the silence began: a holder that renewed its lease since keeps it.
// Safety does not rest on this rule: a deposed holder that comes back
// finds its table writes refused by the server (they are fenced on the
// lease revision) and its commands refused by every region that has seen
// the new epoch; it steps down at its first renewal or write, and renews
// at once after a reconnect.

// probeAnswerer answers the probes of the other candidates.
type probeAnswerer struct {
	nc      *nats.Conn
	subject string
	id      string
	sub     *nats.Subscription
	ok      bool      // an answer of its own came back: the others can probe it
	tried   time.Time // when it last asked itself, in vain
}

// answerProbes subscribes to this candidate's probe subject.
func (n *Node) answerProbes() (*probeAnswerer, error) {
	p := &probeAnswerer{nc: n.cfg.Conn, id: nuid.Next()}
	p.subject = n.cfg.Subjects.Coordinator(p.id)
	reply := []byte(n.cfg.Region)
	sub, err := n.cfg.Conn.Subscribe(p.subject, func(m *nats.Msg) { _ = m.Respond(reply) })
	if err != nil {
		return p, err
	}
	p.sub = sub
	return p, nil
}

// checked returns the probe id to write into the lease: the id, once a
// probe of its own was answered (the subscription is known to the server
// and permitted), or "" (candidates then wait for the lease to expire).
//
// A check that failed is tried again 10 s later at the earliest, so that a
// candidate without the permissions (credentials from before the probe
// subject existed) does not wait for it at every campaign.
func (p *probeAnswerer) checked(ctx context.Context) string {
	if p.sub == nil {
		return ""
	}
	if !p.ok && time.Since(p.tried) > 10*time.Second {
		rctx, cancel := context.WithTimeout(ctx, 250*time.Millisecond)
		_, err := p.nc.RequestWithContext(rctx, p.subject, nil)
		cancel()
		p.ok, p.tried = err == nil, time.Now()
	}
	if !p.ok {
		return ""
	}
	return p.id
}

func (p *probeAnswerer) stop() {
	if p.sub != nil {
		_ = p.sub.Unsubscribe()
	}
}

// silence is a candidate's count of the holder's silence: the decision
// whether to depose it, apart from the I/O.
type silence struct {
	window time.Duration // HolderSilence
	probe  string        // the holder's probe id the count is about
	since  time.Time     // the first "no responders" of the run; zero: none
	rev    uint64        // the lease revision when the run began
	// gone: a server reported that the holder's client closed or reset its
	// connection (Disconnect.ByClient): nobody is reconnecting, so the
	// first "no responders" deposes it, without the window.
	gone bool
}

// holder starts the count over if the lease names another holder.
func (s *silence) holder(probe string) {
	if probe != s.probe {
		*s = silence{window: s.window, probe: probe}
	}
}

// answered: the holder answered, or the probe failed otherwise than with
// "no responders" (a timeout proves nothing): start over.
func (s *silence) answered() { s.since, s.rev, s.gone = time.Time{}, 0, false }

// missed records "no responders" at now. It says whether the run is new
// (the caller then reads the lease revision: begin), and whether the
// holder has been silent for the whole window (depose).
func (s *silence) missed(now time.Time) (begin, depose bool) {
	if s.since.IsZero() {
		s.since = now
		return true, false
	}
	return false, s.rev != 0 && (s.gone || now.Sub(s.since) >= s.window)
}

// waitForVacancy returns when the lease looks free (released, expired, or
// deposed by this candidate because its holder's connection is gone),
// after LeaseTTL/2 at the latest, or when ctx ends. s counts the holder's
// silence across calls.
func (n *Node) waitForVacancy(ctx context.Context, s *silence) {
	wctx, cancel := context.WithTimeout(ctx, n.cfg.LeaseTTL/2)
	defer cancel()
	events, err := n.cfg.Store.WatchCoordinator(wctx)
	if err != nil {
		<-wctx.Done()
		return
	}
	var holder protocol.CoordinatorInfo
	probe := time.NewTimer(time.Hour)
	probe.Stop()
	defer probe.Stop()
	// Probes come every HolderProbe, and thrice as often through a silence.
	schedule := func(d time.Duration) {
		if n.cfg.HolderProbe > 0 && s.probe != "" {
			probe.Reset(d)
		}
	}
	for {
		select {
		case <-wctx.Done():
			return
		case ev, ok := <-events:
			if !ok || !ev.Synced && ev.Info == nil {
				return
			}
			if ev.Info != nil && ev.Info.Probe != holder.Probe {
				holder = *ev.Info
				s.holder(holder.Probe)
				schedule(0)
			}
		case c := <-n.closed:
			if c.Conn == holder.Conn && !holder.Conn.IsZero() {
				s.gone = s.gone || c.ByClient
				schedule(0)
			}
		case <-probe.C:
			if n.probeHolder(wctx, holder, s) {
				return
			}
			if s.since.IsZero() {
				schedule(n.cfg.HolderProbe)
			} else {
				schedule(s.window / 3)
			}
		}
	}
}

// probeHolder probes the lease holder once and counts the outcome; it
// deposes the holder once it has been silent for the whole window, or at
// its first "no responders" after the server reported its connection
// closed or reset, and reports whether it did.
func (n *Node) probeHolder(ctx context.Context, holder protocol.CoordinatorInfo, s *silence) bool {
	// A short timeout: a probe that crossed the holder's death on the way
	// is lost with its connection, and a timeout starts the count over.
	pctx, cancel := context.WithTimeout(ctx, s.window/3)
	_, err := n.cfg.Conn.RequestWithContext(pctx, n.cfg.Subjects.Coordinator(holder.Probe), nil)
	cancel()
	if !errors.Is(err, nats.ErrNoResponders) {
		s.answered()
		return false
	}
	begin, depose := s.missed(time.Now())
	if begin {
		// The revision to depose at: read now, so that a renewal by a
		// holder that comes back makes the deposition fail.
		info, rev, err := n.cfg.Store.Coordinator(ctx)
		if err != nil || info.Probe != holder.Probe {
			s.answered()
			return false
		}
		s.rev = rev
		depose = s.gone
	}
	if !depose {
		return false
	}
	silent := time.Since(s.since)
	err = n.cfg.Store.DeposeCoordinator(ctx, s.rev)
	if err != nil {
		if !errors.Is(err, kvstate.ErrConflict) {
			n.log.Warn("cannot depose the coordinator whose connection is gone", "holder", holder.Region, "err", err)
		}
		s.answered()
		return false
	}
	n.log.Info("deposed the coordinator: its connection is gone (no responders on its probe subject)",
		"holder", holder.Region, "revision", s.rev, "silent_for", duration(silent), "closed_by_client", s.gone)
	return true
}
