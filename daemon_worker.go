package natshard

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"time"

	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// A daemon's worker: the entity, and the goroutine that runs the daemon's
// Run while the worker is below the count, its shard is served here, and
// it holds its claim (docs/PROTOCOL.md, "Daemons").

// daemonWorkerFactory activates a worker entity: it starts the worker's
// goroutine (supervise), unless the entity is no worker below the count,
// which passivates (and so is forgotten).
func daemonWorkerFactory(ctx context.Context, id string) (Entity, error) {
	env := EnvFrom(ctx)
	if env == nil || env.h == nil || env.h.daemon == nil || env.h.agent == nil {
		return nil, errors.New("natshard: a daemon's worker activated outside its node")
	}
	d := env.h.daemon
	w := &daemonWorker{d: d, env: env, index: protocol.WorkerIndex(id, env.h.t.Shards), done: make(chan struct{})}
	if !d.wanted(w.index) {
		env.Passivate()
		close(w.done)
		return w, nil
	}
	// The worker's own context: the Env, not the activating message's
	// trace; ended by Stop, or at once when the shard is dropped.
	wctx, cancel := context.WithCancel(withEnv(context.Background(), env))
	unlink := context.AfterFunc(ctx, cancel)
	w.cancel = func() { unlink(); cancel() }
	go w.supervise(wctx)
	return w, nil
}

// daemonWorker is a worker's entity. Its goroutine (supervise) runs the
// daemon's Run while the worker is below the count and its shard served
// here (region.Agent.Serving), and Stop ends it and waits for Run to
// return.
type daemonWorker struct {
	d      *daemonHost
	env    *Env
	index  int // -1: no worker
	cancel context.CancelFunc
	done   chan struct{} // closed when supervise returned (Run is not running)

	mu       sync.Mutex
	running  bool
	restarts int
	lastErr  string
}

// workerStatus is a worker's answer to any message: shardctl daemon shows
// it.
type workerStatus struct {
	Worker   int    `json:"worker"`
	Region   string `json:"region"`
	Running  bool   `json:"running"`
	Restarts int    `json:"restarts"`
	Error    string `json:"error,omitempty"`
}

// Handle answers the worker's status; a worker the count no longer
// includes passivates.
func (w *daemonWorker) Handle(context.Context, *Message) ([]byte, error) {
	if !w.d.wanted(w.index) {
		w.env.Passivate()
	}
	w.mu.Lock()
	st := workerStatus{Worker: w.index, Region: w.env.Region, Running: w.running, Restarts: w.restarts, Error: w.lastErr}
	w.mu.Unlock()
	return json.Marshal(st)
}

// Stop cancels Run and waits until it has returned, or until ctx (the stop
// timeout) ends: then the shard moves on without it, and the worker's next
// run waits for its claim until it returns.
func (w *daemonWorker) Stop(ctx context.Context) error {
	if w.cancel == nil {
		return nil
	}
	w.cancel()
	select {
	case <-w.done:
		return nil
	case <-ctx.Done():
		w.env.Logger().Error("daemon worker did not return after its context ended; its shard moves on without it, and the worker runs nowhere else until it returns", "worker", w.index)
		return fmt.Errorf("natshard: daemon worker %d did not return in time: %w", w.index, ctx.Err())
	}
}

// runnable reports whether the worker should run here now, with channels
// closed when that may have changed.
func (w *daemonWorker) runnable() (ok bool, served, counted <-chan struct{}) {
	serving, served := w.env.h.agent.Serving(w.env.Shard)
	n, counted := w.d.count()
	return serving && w.index < n, served, counted
}

// supervise runs Run whenever the worker is runnable and holds its claim,
// until ctx ends.
func (w *daemonWorker) supervise(ctx context.Context) {
	defer close(w.done)
	log := w.env.Logger()
	backoff := restartFirst
	for {
		if !w.waitRunnable(ctx) {
			return
		}
		rev, ok := w.claim(ctx)
		if !ok {
			if ctx.Err() != nil {
				return
			}
			continue
		}
		began := time.Now()
		err, cut := w.runOnce(ctx)
		w.release(rev)
		switch {
		case ctx.Err() != nil:
			log.Debug("daemon worker stopped", "worker", w.index)
			return
		case cut:
			log.Debug("daemon worker paused", "worker", w.index) // not served here for now, or counted out
			continue
		}
		if time.Since(began) >= restartMax {
			backoff = restartFirst
		}
		w.mu.Lock()
		w.restarts++
		w.lastErr = fmt.Sprint(err)
		w.mu.Unlock()
		log.Warn("daemon worker returned while it should run; starting it again", "worker", w.index, "err", err, "in", backoff.String())
		if !wait.Sleep(ctx, backoff) {
			return
		}
		backoff = min(2*backoff, restartMax)
	}
}

// claimPoll is how often a worker waiting for its claim looks again.
const claimPoll = 50 * time.Millisecond

// releaseWait bounds the release of a claim before the worker's Stop
// returns; a release not done by then is retried in the background.
const releaseWait = 2 * time.Second

// claim takes the worker's claim (kvstate.Store.ClaimWorker) and returns
// its revision, once no other run holds it: a run releases it when it
// returns; a claim of a region that has been missing from the registry
// (crashed, or cut off: it fenced itself and cancelled its runs by 3/4
// of the lease TTL after its last renewal) for a lease TTL is taken over.
// false when the worker stopped being runnable, or ctx ended, first.
func (w *daemonWorker) claim(ctx context.Context) (uint64, bool) {
	store := w.env.h.store
	mine := protocol.WorkerClaim{Region: w.env.Region, Instance: w.env.h.agent.Instance()}
	var lost lostClaim
	backoff := wait.RetryFirst
	for {
		ok, served, counted := w.runnable()
		if !ok {
			return 0, false
		}
		free, rev, err := w.claimable(ctx, mine, &lost)
		if err == nil && free {
			var crev uint64
			if crev, err = store.ClaimWorker(ctx, w.index, mine, rev); err == nil {
				return crev, true
			}
		}
		pause := claimPoll
		if err != nil && !errors.Is(err, kvstate.ErrConflict) {
			w.env.Logger().Debug("cannot take the daemon worker's claim yet", "worker", w.index, "err", err)
			pause, backoff = backoff, wait.Next(backoff)
		} else {
			backoff = wait.RetryFirst
		}
		select {
		case <-ctx.Done():
			return 0, false
		case <-served:
		case <-counted:
		case <-time.After(pause):
		}
	}
}

// lostClaim is a claim whose region was missing from the registry: the
// claim's revision, and when that was first seen.
type lostClaim struct {
	rev   uint64
	since time.Time
}

// claimable reads the worker's claim and reports whether this worker may
// take it at revision rev: no run holds it, or the run's region (another
// process's) has been missing from the registry for a lease TTL, since it
// was first seen missing (lost).
func (w *daemonWorker) claimable(ctx context.Context, mine protocol.WorkerClaim, lost *lostClaim) (bool, uint64, error) {
	store := w.env.h.store
	held, rev, err := store.WorkerClaim(ctx, w.index)
	switch {
	case errors.Is(err, kvstate.ErrMalformed):
		return true, rev, nil
	case err != nil:
		return false, 0, err
	case held == nil:
		return true, rev, nil
	case held.Instance == mine.Instance:
		return false, rev, nil // a run of this process: it releases the claim when it returns
	}
	info, _, err := store.Region(ctx, held.Region)
	switch {
	case err == nil && info.Instance == held.Instance:
		*lost = lostClaim{}
		return false, rev, nil // its process is registered: it releases the claim when its run returns
	case err != nil && !errors.Is(err, kvstate.ErrNotFound):
		return false, rev, err
	}
	if lost.rev != rev {
		*lost = lostClaim{rev: rev, since: time.Now()}
		w.env.Logger().Debug("the daemon worker's last region is gone: it is taken over after a lease TTL", "worker", w.index, "last_region", held.Region, "lease_ttl", w.d.h.node.opts.LeaseTTL.String())
	}
	return time.Since(lost.since) >= w.d.h.node.opts.LeaseTTL, rev, nil
}

// release removes the worker's claim taken at rev, now that its run
// returned; a release that fails is retried in the background.
func (w *daemonWorker) release(rev uint64) {
	ctx, cancel := context.WithTimeout(context.Background(), releaseWait)
	err := w.env.h.store.ReleaseWorker(ctx, w.index, rev)
	cancel()
	if err != nil && !errors.Is(err, kvstate.ErrConflict) {
		w.d.releaseLater(w.index, rev, err)
	}
}

// waitRunnable waits until the worker is runnable (true) or ctx ends. A
// worker the count left out asks for a turn, in which it passivates.
func (w *daemonWorker) waitRunnable(ctx context.Context) bool {
	asked := false
	for {
		ok, served, counted := w.runnable()
		if ok {
			return true
		}
		if !w.d.wanted(w.index) && !asked {
			asked = true
			_ = w.env.StartTimer(daemonStopTimer, 0, nil) // refused while it stops: it stops anyway
		}
		select {
		case <-ctx.Done():
			return false
		case <-served:
		case <-counted:
		}
	}
}

// runOnce runs Run until it returns; it cancels it when the worker stops
// being runnable. cut reports that Run's context was ended (by that, or
// by ctx).
func (w *daemonWorker) runOnce(ctx context.Context) (err error, cut bool) {
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		for {
			ok, served, counted := w.runnable()
			if !ok {
				cancel()
				return
			}
			select {
			case <-rctx.Done():
				return
			case <-served:
			case <-counted:
			}
		}
	}()
	w.setRunning(true)
	w.env.Logger().Debug("daemon worker started", "worker", w.index)
	err = w.call(rctx)
	w.setRunning(false)
	cut = rctx.Err() != nil
	cancel()
	<-watched
	return err, cut
}

// call runs Run, a panic recovered as an error.
func (w *daemonWorker) call(ctx context.Context) (err error) {
	defer func() {
		if r := recover(); r != nil {
			w.env.Logger().Error("daemon worker panicked", "worker", w.index, "panic", fmt.Sprint(r), "stack", string(debug.Stack()))
			err = fmt.Errorf("panic: %v", r)
		}
	}()
	return w.d.run(ctx, w.index)
}

func (w *daemonWorker) setRunning(on bool) {
	w.mu.Lock()
	w.running = on
	w.mu.Unlock()
}
