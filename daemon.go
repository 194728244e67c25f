package natshard

import (
	"context"
	"errors"
	"fmt"
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
		//lint:ignore ST1005 a Validate error begins with the name of the field at fault, as its others do
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
