package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"sync"

	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// worker is a daemon's worker as shardctl daemon shows it: its place, and
// what it answered (natshard's workers answer any message with their
// status).
type worker struct {
	Worker   int    `json:"worker"`
	Shard    int    `json:"shard"`
	Entity   string `json:"entity"`
	Region   string `json:"region"` // the one that answered, else the table's owner
	Answered bool   `json:"answered"`
	Running  bool   `json:"running"`
	Restarts int    `json:"restarts"`
	Error    string `json:"error,omitempty"`
}

// workerAsks bounds the workers asked at once.
const workerAsks = 32

func cmdDaemon(ctx context.Context, c *client, _ []string, out io.Writer) error {
	n, err := c.daemonWorkers(ctx)
	if err != nil {
		return err
	}
	rows, err := c.store.Shards(ctx)
	if err != nil {
		return c.jetStreamErr(err, "read the shard table")
	}
	owners := map[int]string{}
	for _, r := range rows {
		owners[r.Shard] = r.Region
	}
	workers := make([]worker, n)
	slots := make(chan struct{}, workerAsks)
	var wg sync.WaitGroup
	for i := range workers {
		id := protocol.WorkerID(i, c.shards)
		w := &workers[i]
		*w = worker{Worker: i, Shard: i % c.shards, Entity: id, Region: owners[i%c.shards]}
		slots <- struct{}{}
		wg.Go(func() {
			defer func() { <-slots }()
			c.askWorker(ctx, w)
		})
	}
	wg.Wait()
	if c.opts.JSON {
		return writeJSON(out, struct {
			Workers int      `json:"workers"`
			List    []worker `json:"list"`
		}{n, workers})
	}
	fmt.Fprintf(out, "%d workers\n", n)
	if n == 0 {
		return nil
	}
	var cells [][]any
	for _, w := range workers {
		running := "no answer"
		if w.Answered {
			running = map[bool]string{true: "yes", false: "no"}[w.Running]
		}
		cells = append(cells, []any{w.Worker, w.Shard, orDash(w.Region), running, w.Restarts, orDash(w.Error)})
	}
	return table(out, []string{"WORKER", "SHARD", "REGION", "RUNNING", "RESTARTS", "LAST ERROR"}, cells)
}

// askWorker asks worker w for its status, which starts it if it is not
// active (as every process that hosts the daemon does every 10 s).
func (c *client) askWorker(ctx context.Context, w *worker) {
	ctx, cancel := context.WithTimeout(ctx, c.opts.Timeout)
	defer cancel()
	m, err := c.nc.RequestWithContext(ctx, c.subjects.Entity(w.Shard, w.Entity), nil)
	if err != nil {
		return
	}
	var st struct {
		Region   string `json:"region"`
		Running  bool   `json:"running"`
		Restarts int    `json:"restarts"`
		Error    string `json:"error"`
	}
	if json.Unmarshal(m.Data, &st) != nil {
		return
	}
	w.Answered, w.Region, w.Running, w.Restarts, w.Error = true, st.Region, st.Running, st.Restarts, st.Error
}

func cmdScale(ctx context.Context, c *client, args []string, out io.Writer) error {
	n, err := strconv.Atoi(args[0])
	if err != nil || n < 0 || n > protocol.MaxWorkers {
		return fmt.Errorf("%w: %q is no worker count (0 to %d)", errUsage, args[0], protocol.MaxWorkers)
	}
	was, err := c.daemonWorkers(ctx)
	if err != nil {
		return err
	}
	if err := c.store.ScaleDaemon(ctx, n); err != nil {
		return c.jetStreamErr(err, "store the worker count")
	}
	if c.opts.JSON {
		return writeJSON(out, struct {
			Workers int `json:"workers"`
			Was     int `json:"was"`
		}{n, was})
	}
	say(out, "daemon %s: %d workers (was %d)\n", c.opts.Type, n, was)
	return nil
}

// daemonWorkers reads the type's worker count; an error that says so when
// the type is no daemon.
func (c *client) daemonWorkers(ctx context.Context) (int, error) {
	n, _, err := c.store.DaemonWorkers(ctx)
	if errors.Is(err, kvstate.ErrNotFound) {
		return 0, fmt.Errorf("type %q is not a daemon: it stores no worker count (natshard.Daemon hosts one, as shardd --kind daemon does)", c.opts.Type)
	}
	if err != nil {
		return 0, c.jetStreamErr(err, "read the worker count")
	}
	return n, nil
}
