package natshard

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/internal/wait"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// Daemon is a sharded daemon process (Akka's ShardedDaemonProcess): a
// count of numbered workers, 0 to Workers-1, kept running across the
// processes that host it, each once. Worker i runs in one process at a
// time; it moves when processes join and leave, and starts again in
// another when its process dies. Host it with Type:
//
//	// indexPartition indexes partition index until ctx ends.
//	var Indexer = natshard.Daemon{Name: "indexer", Workers: 4, Run: indexPartition}
//
//	node, err := natshard.Start(ctx, opts, Indexer.Type())
//
// The count is stored with the type and changed at run time with
// ScaleDaemon (or shardctl scale): every host starts the workers
// added and stops those removed.
//
// Once means at most one run of a worker at any time: a worker's run
// starts only once its shard is live in the process and its previous
// run, wherever it was, returned, or the process of that run has been
// gone from the registry for a lease TTL (a claim per worker in the
// type's bucket). docs/GUIDE.md, "Workers kept running: daemons", says
// more, and what is left: a process frozen past its lease.
type Daemon struct {
	// Name of the daemon: the name of its entity type (subjects
	// shard.<Name>.<shard>.<worker>, KV bucket natshard_<Name>).
	Name string
	// Workers is the count when the daemon is first hosted; it is then
	// stored, and the stored count wins: change it with ScaleDaemon. 0
	// means the stored count (a process that joins a daemon without
	// knowing it); a daemon that has none yet needs 1 to MaxWorkers.
	Workers int
	// Run is worker index, run in a goroutine of the process that holds
	// it. Its ctx ends when the worker must stop here: its shard leaves
	// the process (a move, a leave, a stop), the process loses its NATS
	// connection (it starts the worker again once it has confirmed the
	// shard is still its own), or the count drops to index or below.
	// Return promptly then, within a second: the worker's next run, here
	// or in another process, waits until this one returned (a Run that
	// never returns keeps its worker from running anywhere else while
	// its process is registered), but waits for a process cut off from
	// NATS only a lease TTL after it was removed, a quarter of the TTL
	// after that process ended the context. A Run that returns while its
	// worker should run (an error, nil, or a panic) is started again
	// after a pause (1 s, doubling up to 30 s), and the error is logged.
	// EnvFrom(ctx) gives the worker's Env: its region, the node's
	// connection and client, the type's state store, a logger.
	Run func(ctx context.Context, index int) error
}

// MaxWorkers bounds a daemon's worker count.
const MaxWorkers = protocol.MaxWorkers

// DaemonKeepAlive is how often every process that hosts a daemon asks
// each worker below the count, which starts a worker that nothing started
// yet (its first start, a count raised while a process was away). A
// worker's shard's new owner starts it at once (remembered entities); the
// keep-alive is the rest.
const DaemonKeepAlive = 10 * time.Second

// ErrNotDaemon: ScaleDaemon or DaemonWorkers named a type that is not a
// daemon (it stores no worker count), or no type at all.
var ErrNotDaemon = errors.New("natshard: not a daemon")

// daemonStrategy places a daemon's shards by the workers they hold (a
// live entity weighs as 1000 messages per second: the keep-alives are a
// few per 10 s), with a narrow band, so that the workers spread within
// one of even.
const daemonStrategy = "load-aware:entities-weight=1000,hysteresis=0.01"

// The pause before a worker whose Run returned is started again: it
// doubles from restartFirst up to restartMax, and starts again from
// restartFirst after a run that lasted restartMax.
const (
	restartFirst = time.Second
	restartMax   = 30 * time.Second
)

// daemonStopTimer is the name of the timer a worker that the count no
// longer includes starts to get a turn in which it passivates itself.
const daemonStopTimer = "natshard-daemon-stop"

// Type returns the entity type that hosts the daemon's workers, for Start
// or Run: its entities are the workers, remembered (a shard's new owner
// starts them at once) and never passivated for idleness, with the
// strategy load-aware by live entities and the periodic rebalance on, so
// that the workers spread evenly over the processes. Worker i lives in
// shard i % Shards: Shards (DefaultShards) is how many workers get a shard
// of their own. Set the Type's other knobs (Replicas, HandOffTimeout, ...)
// on what it returns.
func (d Daemon) Type() Type {
	return Type{
		Name:              d.Name,
		Entity:            daemonWorkerFactory,
		Strategy:          daemonStrategy,
		Remember:          true,
		IdleTimeout:       Off,
		RebalanceInterval: DefaultRebalanceInterval,
		daemon:            &daemonSpec{workers: d.Workers, run: d.Run},
	}
}

// daemonSpec is what a Type of a Daemon carries of it.
type daemonSpec struct {
	workers int
	run     func(ctx context.Context, index int) error
}

// validate names what is wrong with t's daemon.
func (s *daemonSpec) validate(t Type) []error {
	var errs []error
	if s.run == nil {
		errs = append(errs, errors.New("Daemon.Run: required"))
	}
	if s.workers < 0 || s.workers > MaxWorkers {
		errs = append(errs, fmt.Errorf("Daemon.Workers: %d is out of range 0..%d (0: the stored count)", s.workers, MaxWorkers))
	}
	if !t.Remember {
		errs = append(errs, errors.New("Remember: a daemon's workers are remembered entities; keep the Type that Daemon.Type returns"))
	}
	return errs
}

// ScaleDaemon sets the worker count of daemon name (0 to MaxWorkers; 0
// stops them all) through nc: it returns once the count is stored, and
// every process that hosts the daemon starts the workers added and stops
// those removed as soon as it sees it (a watch: milliseconds). ErrNotDaemon
// when name is not a daemon.
func ScaleDaemon(ctx context.Context, nc *nats.Conn, name string, workers int) error {
	if workers < 0 || workers > MaxWorkers {
		return fmt.Errorf("natshard: scale daemon %q: %d workers, out of range 0..%d", name, workers, MaxWorkers)
	}
	store, err := bindDaemon(ctx, nc, name)
	if err != nil {
		return err
	}
	if err := store.ScaleDaemon(ctx, workers); err != nil {
		return daemonErr(name, "scale", err)
	}
	return nil
}

// DaemonWorkers returns the worker count of daemon name, read through nc;
// ErrNotDaemon when name is not a daemon.
func DaemonWorkers(ctx context.Context, nc *nats.Conn, name string) (int, error) {
	store, err := bindDaemon(ctx, nc, name)
	if err != nil {
		return 0, err
	}
	n, _, err := store.DaemonWorkers(ctx)
	if err != nil {
		return 0, daemonErr(name, "read", err)
	}
	return n, nil
}

func bindDaemon(ctx context.Context, nc *nats.Conn, name string) (*kvstate.Store, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("natshard: daemon %q: %w", name, err)
	}
	store, err := kvstate.Bind(ctx, js, name, kvstate.Options{})
	if err != nil {
		return nil, daemonErr(name, "open", err)
	}
	return store, nil
}

func daemonErr(name, op string, err error) error {
	if errors.Is(err, kvstate.ErrNotFound) {
		return fmt.Errorf("%w: %q has no worker count (%s: %w)", ErrNotDaemon, name, op, err)
	}
	return fmt.Errorf("natshard: %s daemon %q: %w", op, name, err)
}

// daemonHost is a daemon in one node: the count as the node knows it, and
// the keeper that follows it and asks the workers (keep).
type daemonHost struct {
	h   *hosted
	run func(ctx context.Context, index int) error

	mu      sync.Mutex
	workers int
	changed chan struct{} // closed when workers changes
	ids     []string      // WorkerID of each index, made as needed
	ended   bool          // end began: nothing more in the background

	ctx     context.Context    // until the node stops
	stop    context.CancelFunc // ends ctx
	started bool               // keep runs (start)
	done    chan struct{}      // closed when keep returned
	pings   sync.WaitGroup     // keep-alives and releases in the background
}

// openDaemon reads (or, for a new daemon, stores) the count of h's daemon.
func (h *hosted) openDaemon(ctx context.Context, spec *daemonSpec) (*daemonHost, error) {
	var n int
	err := h.untilAvailable(ctx, "the daemon's worker count in "+kvstate.BucketName(h.t.Name), func(ctx context.Context) (err error) {
		if spec.workers > 0 {
			n, err = h.store.EnsureDaemon(ctx, spec.workers)
			return err
		}
		n, _, err = h.store.DaemonWorkers(ctx)
		return err
	})
	if errors.Is(err, kvstate.ErrNotFound) {
		return nil, fmt.Errorf("natshard: daemon %q: Workers: 0 means the stored count, and none is stored yet; give the count", h.t.Name)
	}
	if err != nil {
		return nil, fmt.Errorf("natshard: daemon %q: %w", h.t.Name, err)
	}
	if spec.workers > 0 && n != spec.workers {
		h.log.Info("the daemon runs its stored worker count, not the one configured; change it with shardctl scale", "workers", n, "configured", spec.workers)
	}
	d := &daemonHost{h: h, run: spec.run, workers: n, changed: make(chan struct{}), done: make(chan struct{})}
	d.ctx, d.stop = context.WithCancel(context.Background())
	return d, nil
}

// count is the worker count, with a channel closed when it changes.
func (d *daemonHost) count() (int, <-chan struct{}) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.workers, d.changed
}

// wanted reports whether worker index is below the count.
func (d *daemonHost) wanted(index int) bool {
	n, _ := d.count()
	return index >= 0 && index < n
}

// set makes n the count; it reports whether it changed.
func (d *daemonHost) set(n int) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if n == d.workers {
		return false
	}
	d.workers = n
	close(d.changed)
	d.changed = make(chan struct{})
	return true
}

// id is the entity id of worker index.
func (d *daemonHost) id(index int) string {
	d.mu.Lock()
	defer d.mu.Unlock()
	for len(d.ids) <= index {
		d.ids = append(d.ids, protocol.WorkerID(len(d.ids), d.h.t.Shards))
	}
	return d.ids[index]
}

// start runs the keeper until the node stops (end).
func (d *daemonHost) start() {
	d.started = true
	go d.keep(d.ctx)
}

// end stops the keeper and waits for it, its keep-alives and its
// releases.
func (d *daemonHost) end() {
	d.mu.Lock()
	d.ended = true
	d.mu.Unlock()
	d.stop()
	if d.started {
		<-d.done
	}
	d.pings.Wait()
}

// releaseLater retries the release of worker index's claim taken at rev
// until it is done, the claim was taken over, or the node stops (its
// registration is then removed, and the claim is taken over a lease TTL
// later).
func (d *daemonHost) releaseLater(index int, rev uint64, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.ended {
		d.h.log.Warn("cannot release a daemon worker's claim as the node stops: its next run waits until a lease TTL after the node deregistered", "worker", index, "err", err)
		return
	}
	d.h.log.Warn("cannot release a daemon worker's claim; retrying: its next run waits for it", "worker", index, "err", err)
	d.pings.Go(func() {
		for backoff := wait.RetryFirst; wait.Sleep(d.ctx, backoff); backoff = wait.Next(backoff) {
			err := d.h.store.ReleaseWorker(d.ctx, index, rev)
			if err == nil || errors.Is(err, kvstate.ErrConflict) {
				return
			}
		}
	})
}

// keep follows the stored count (a watch, made again when it is lost) and
// asks every worker below it: at once, whenever the count changes, and
// every DaemonKeepAlive.
func (d *daemonHost) keep(ctx context.Context) {
	defer close(d.done)
	tick := time.NewTicker(DaemonKeepAlive)
	defer tick.Stop()
	retry := time.NewTimer(0)
	defer retry.Stop()
	backoff := wait.RetryFirst
	var counts <-chan int
	d.askAll(ctx)
	for {
		select {
		case <-ctx.Done():
			return
		case <-retry.C:
			ch, err := d.h.store.WatchDaemon(ctx)
			if err != nil {
				if ctx.Err() == nil {
					d.h.log.Debug("cannot watch the daemon's worker count; retrying", "err", err, "in", backoff.String())
				}
				retry.Reset(backoff)
				backoff = wait.Next(backoff)
				continue
			}
			counts, backoff = ch, wait.RetryFirst
		case n, ok := <-counts:
			if !ok {
				counts = nil
				retry.Reset(backoff)
				continue
			}
			if d.set(n) {
				d.h.log.Info("daemon scaled", "workers", n)
				d.askAll(ctx)
			}
		case <-tick.C:
			d.askAll(ctx)
		}
	}
}

// askConcurrency bounds the requests of a keep-alive in flight.
const askConcurrency = 32

// askAll asks every worker below the count, in the background, each
// within DaemonKeepAlive: a request to a worker activates it if it is
// not active.
func (d *daemonHost) askAll(ctx context.Context) {
	n, _ := d.count()
	d.pings.Go(func() {
		ctx, cancel := context.WithTimeout(ctx, DaemonKeepAlive)
		defer cancel()
		slots := make(chan struct{}, askConcurrency)
		var wg sync.WaitGroup
		for i := range n {
			select {
			case slots <- struct{}{}:
			case <-ctx.Done():
				wg.Wait()
				return
			}
			id := d.id(i)
			wg.Go(func() {
				defer func() { <-slots }()
				if _, err := d.h.node.client.Request(ctx, d.h.t.Name, id, nil); err != nil && ctx.Err() == nil {
					d.h.log.Debug("daemon keep-alive: no answer from a worker", "worker", id, "err", err)
				}
			})
		}
		wg.Wait()
	})
}

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
