package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/natshard/natshard/internal/benchlab"
)

// command is one of shardctl's commands. Those that talk to a type run
// with a connection (run); the others (local) parse their own arguments.
type command struct {
	name  string
	args  string // the arguments and own flags, for usage lines
	short string // one line, for the list of commands
	// long says what the command does, for its help; examples are lines
	// of "# what it does" comments and commands.
	long, examples string
	group          string
	nargs          int
	flags          []string // its own flags, among the flag set's
	run            func(ctx context.Context, c *client, args []string, out io.Writer) error
	local          func(ctx context.Context, l local, args []string) error
}

// local is what a command that makes no connection gets.
type local struct {
	o              options
	fs             *flag.FlagSet // the global flags, as parsed
	stdout, stderr io.Writer
}

// groups orders the groups of commands in help.
var groups = []string{"Inspect", "Talk to entities", "Operate", "Set up and measure"}

// commands lists shardctl's commands, in the order help shows them.
var commands []command

func init() {
	commands = []command{
		{
			name: "status", short: "coordinator, epoch, regions, shards allocated and unowned", group: "Inspect", run: cmdStatus,
			long: `Shows the type's coordinator (the region whose process leads, and its
epoch), how many regions are registered and how many shards are
allocated, active and unowned. While no coordinator answers (a failover
lasts at most a lease TTL) it reads KV instead, and says so.`,
			examples: `shardctl status
# Another type, on another server, as JSON.
shardctl --nats nats://n1:4222 --type orders status --json`,
		},
		{
			name: "regions", short: "the registered regions and how many shards each holds", group: "Inspect", run: cmdRegions,
			long: `Lists the registered regions: the shards each holds, its application
version, whether it is leaving (drained, or its process is stopping) and
its incarnation (a new one each time its process registers).`,
			examples: `shardctl regions`,
		},
		{
			name: "region", args: "<id> [--limit N]", short: "a region's shards and their entity ids", group: "Inspect", nargs: 1, flags: []string{"limit"}, run: cmdRegion,
			long: `Asks the region itself which shards it serves, in which mode (live,
replaying its buffer, or paused for a handoff), and which entities it
holds (at most --limit ids). A region that does not answer is reported,
with the shards the table gives it.`,
			examples: `shardctl region b
shardctl region b --limit 10 --json`,
		},
		{
			name: "shards", short: "every shard with its region, state and pin", group: "Inspect", run: cmdShards,
			long: `Prints the shard table: each shard's region, its state (active,
handoff, binding, parked, unowned), the region a moving shard comes from,
and its pin.`,
			examples: `shardctl shards
# The shards that are not active, with jq.
shardctl shards --json | jq '.[] | select(.state != "active")'`,
		},
		{
			name: "shard", args: "<n> [--limit N]", short: "a shard's owner, state, pin and entity ids", group: "Inspect", nargs: 1, flags: []string{"limit"}, run: cmdShard,
			long: `Shows a shard's row of the table and what the regions that hold it
(its owner, and during a move its source) report: mode, entities and
their ids (at most --limit).`,
			examples: `shardctl shard 17`,
		},
		{
			name: "locate", args: "<entity>", short: "the shard, subject and owner of an entity", group: "Inspect", nargs: 1, run: cmdLocate,
			long: `Computes the entity's shard (fnv1a32 of its id, modulo the shard count:
the NATS server's partition() mapping) and subject, and shows the shard's
region and state.`,
			examples: `shardctl locate order-42`,
		},
		{
			name: "stats", short: "per region and shard: entities, buffered messages, messages/s", group: "Inspect", run: cmdStats,
			long: `Asks every region for its shards' entities and message rates, and
JetStream for the messages buffered per shard (moving or parked shards).
Regions that do not answer are reported.`,
			examples: `shardctl stats
shardctl stats --json`,
		},
		{
			name: "watch", args: "[--count N]", short: "print allocations and handoffs as they happen", group: "Inspect", flags: []string{"count"}, run: cmdWatch,
			long: `Prints the coordinator's events as they come, one line each (with
--json, the event): shards parked, handing off, binding and active;
regions registering, leaving, undrained and gone; pins. Events are core
NATS messages: watch sees those published while it runs, and says so
when it is too slow and loses some. Control characters in what the
network sent are printed escaped (\x1b), never raw.`,
			examples: `shardctl watch
# Three events, as JSON lines.
shardctl watch --count 3 --json`,
		},
		{
			name: "daemon", short: "a daemon's workers: where each runs, and whether it does", group: "Inspect", run: cmdDaemon,
			long: `Shows the worker count of a daemon (a type hosted by natshard.Daemon, or
shardd --kind daemon) and asks each worker for its status: the region
that runs it, whether its Run is running (it is not while it waits for
its previous run elsewhere to end, or for its shard), how often it
returned and was started again, and its last error. Asking a worker
starts it if it is not active, as every process of the daemon does
every 10 s.`,
			examples: `shardctl --type projection daemon
shardctl --type projection daemon --json`,
		},
		{
			name: "send", args: "<entity> <payload> [--key K]", short: "publish a message to an entity", group: "Talk to entities", nargs: 2, flags: []string{"key"}, run: cmdSend,
			long: `Publishes the payload ("-": standard input) to the entity's subject, as
any NATS client can (nats pub shard.<type>.<shard>.<entity> ...). With
--key, the message carries it as its Nats-Msg-Id: sent again with the
same key, it is applied once.`,
			examples: `shardctl send order-42 '{"op":"incr","key":"items"}'
echo '{"op":"incr","key":"items"}' | shardctl send order-42 -`,
		},
		{
			name: "request", args: "<entity> <payload> [--key K]", short: "send a request to an entity and print the answer", group: "Talk to entities", nargs: 2, flags: []string{"key"}, run: cmdRequest,
			long: `Sends the payload ("-": standard input) as a request to the entity and
prints the answer, in either delivery mode (to a type of durable delivery
through its stream, as natshard's Client does); an answer with the
Natshard-Error header exits 1. Control characters of the answer, other
than newlines and tabs, are printed escaped. With --key, the request
carries it as its idempotency key (Nats-Msg-Id): sent again with the
same key, it is applied once and answered with the first answer.`,
			examples: `shardctl request order-42 '{"op":"set","key":"status","value":"paid"}'
shardctl request order-42 '{"op":"get"}'
shardctl request order-42 '{"op":"incr","key":"items"}' --key add-item-17`,
		},
		{
			name: "move", args: "<shard> <region> [--wait]", short: "hand a shard off to a region", group: "Operate", nargs: 2, flags: []string{"wait"}, run: cmdMove,
			long: `Asks the coordinator to hand an active shard off to the region: its
owner pauses it and buffers its messages in JetStream, the region replays
them, nothing is lost. A pinned shard moves only to its pin.

With --wait, shardctl follows the move until the shard is active again,
printing each step on stderr, and fails if the shard ends on another
region or --timeout (default 1m with --wait) passes first.`,
			examples: `shardctl move 17 b
# Wait until it is active on b, at most 30 s.
shardctl move 17 b --wait --timeout 30s`,
		},
		{
			name: "drain", args: "<region> [--wait]", short: "hand every shard of a region off and give it no more", group: "Operate", nargs: 1, flags: []string{"wait"}, run: cmdDrain,
			long: `Tells the region to leave: it marks itself leaving in its registration,
and the coordinator gives it no new shard and hands all of its shards
off to the others (at most the coordinator's --max-moves at once). The
process keeps running; undrain lets the region take shards again.

With --wait, shardctl follows the shards off the region, printing each
step on stderr, until it holds none.`,
			examples: `# Empty region c before stopping its process.
shardctl drain c --wait --timeout 5m`,
		},
		{
			name: "undrain", args: "<region> [--wait]", short: "let a drained region take shards again", group: "Operate", nargs: 1, flags: []string{"wait"}, run: cmdUndrain,
			long: `Clears the leaving mark that drain set: allocations and rebalance rounds
count the region again, and the next round moves shards to it
(shardctl rebalance runs one now). It is refused while the region still
holds shards: it is being drained, or its process is stopping (a shardd
that got SIGTERM marks itself leaving too, and exits as soon as it holds
none). Wait for the drain to end (drain --wait), then undrain.

With --wait, shardctl waits until the region's registration no longer
says leaving.`,
			examples: `shardctl drain c --wait
shardctl undrain c --wait
shardctl rebalance --wait`,
		},
		{
			name: "pin", args: "<shard> <region>", short: "keep a shard on a region (moved there by the next round)", group: "Operate", nargs: 2, run: cmdPin,
			long: `Pins a shard to a region: allocations put it there and rebalance rounds
move it there whenever the region is registered and not leaving. The
region need not exist yet. The pin does not move the shard at once: the
next round does.`,
			examples: `shardctl pin 17 a
# Move it there now.
shardctl rebalance --wait`,
		},
		{
			name: "unpin", args: "<shard>", short: "remove a shard's pin", group: "Operate", nargs: 1, run: cmdUnpin,
			long: `Removes a shard's pin; the shard stays where it is until the strategy
moves it.`,
			examples: `shardctl unpin 17`,
		},
		{
			name: "rebalance", args: "[--dry-run | --wait]", short: "run a strategy round now (--dry-run: print the plan only)", group: "Operate", flags: []string{"dry-run", "wait"}, run: cmdRebalance,
			long: `Runs the coordinator's strategy round now, whatever the rebalance
interval, and prints the moves it started. The strategy's own gates hold:
least-shard and load-aware move nothing while shards are moving or
parked. --dry-run prints the plan and moves nothing.

With --wait, shardctl follows the moves until every moved shard is active
again, printing each step on stderr.`,
			examples: `shardctl rebalance --dry-run
shardctl rebalance --wait`,
		},
		{
			name: "scale", args: "<workers>", short: "set a daemon's worker count", group: "Operate", nargs: 1, run: cmdScale,
			long: `Stores a daemon's new worker count (0 stops them all). Every process
that hosts the daemon sees it at once: it starts the workers added and
stops those removed; the others run on.`,
			examples: `shardctl --type projection scale 8
shardctl --type projection daemon`,
		},
		{
			name: "reshard", args: "--shards N", short: "split every shard of the type into N / today's count (N: a multiple)", group: "Operate", flags: []string{"shards"}, run: cmdReshard,
			long: `Grows the type's shard count to N, a multiple of today's count, while it
runs: every shard s of a type of C shards becomes the shards s, s+C, ...
(its children), each on its parent's region, so no entity moves and no
state is copied; the next rebalance rounds spread the children. Each
region stops and restarts the active entities that change shard number.
The coordinator records the split as one fenced change of the type's
configuration: if it dies halfway the next one completes it, and a
split that was not recorded did not happen. Shrinking is refused.

Publishers that still compute the old count keep working: the region of
an entity listens on its old subjects too (the metric
natshard_region_old_subject_messages_total counts what still comes
there). natshard's Client learns the new count at once.

shardctl waits until the split is announced (every region has split) and
prints how long it took; while shards are moving it asks again until
--timeout (default 1m). A type of durable delivery is resharded too
(the parents' owners forward what comes on old subjects through the
stream); a daemon's type cannot be.`,
			examples: `# 128 shards to 256, then spread the children at once.
shardctl reshard --shards 256
shardctl rebalance --wait
# As JSON, for a script.
shardctl reshard --shards 512 --json --timeout 5m`,
		},
		{
			name: "auth", args: "init|user ...", short: "create keys and credentials", group: "Set up and measure", local: localAuth,
			long: authHelp, examples: authExamples,
		},
		{
			name: "bench", args: "[flags]", short: "throughput and latency through entities beside raw NATS or JetStream", group: "Set up and measure", local: localBench,
			long: fmt.Sprintf(`Runs, in one process, an embedded NATS server (or uses --nats), regions
and a coordinator, and prints messages/s and request latency through
entities beside the same workload on raw NATS, with the ratio.
--delivery durable (or both) does the same with a type of durable
delivery, publishing through JetStream, beside raw JetStream twice: in
its best shape (one pull consumer, --best-consumers) and in the type's
shape (a consumer per shard, the shards split over the type's streams).
It also runs requests from concurrent callers (--callers, 64 by default)
through natshard.Client beside nc.Request, and pipelined requests
(%d in flight) beside a plain responder. --handoff and
--failover add handoffs under load, and crashes of regions and of the
coordinator.`, benchlab.PipelineWindow),
			examples: `shardctl bench
shardctl bench --delivery both --json
shardctl bench --handoff --failover --json`,
		},
		{
			name: "completion", args: "bash|zsh|fish", short: "print a shell completion script", group: "Set up and measure", local: localCompletion,
			long: `Prints a script that completes shardctl's commands, their flags and
arguments (shells, help topics, auth roles, files) in bash, zsh or fish.`,
			examples: `# bash, this shell only; or write it to /etc/bash_completion.d/shardctl.
source <(shardctl completion bash)
# zsh: into a directory of $fpath, then restart zsh.
shardctl completion zsh > "${fpath[1]}/_shardctl"
# fish
shardctl completion fish > ~/.config/fish/completions/shardctl.fish`,
		},
		{
			name: "help", args: "[command]", short: "help about shardctl or one of its commands", group: "Set up and measure", local: localHelp,
			long: `Prints the list of commands and the global flags, or a command's help
with examples (as shardctl <command> --help does).`,
			examples: `shardctl help
shardctl help move`,
		},
	}
}

// commandFlags are the flags that belong to single commands.
func commandFlags() []string {
	var names []string
	for _, c := range commands {
		for _, f := range c.flags {
			if !slices.Contains(names, f) {
				names = append(names, f)
			}
		}
	}
	return names
}

// lookup finds a command by name; an unknown name is a usage error that
// suggests the closest command.
func lookup(name string) (*command, error) {
	for i := range commands {
		if commands[i].name == name {
			return &commands[i], nil
		}
	}
	hint := ""
	if s := closest(name); s != "" {
		hint = fmt.Sprintf(" (did you mean %s?)", s)
	}
	return nil, fmt.Errorf("%w: unknown command %q%s; shardctl help lists the commands", errUsage, name, hint)
}

// closest is the command whose name is within two edits of name, or that
// name begins, if any.
func closest(name string) string {
	best, bestD := "", 3
	for _, c := range commands {
		d := editDistance(name, c.name)
		if len(name) >= 2 && strings.HasPrefix(c.name, name) {
			d = 1
		}
		if d < bestD {
			best, bestD = c.name, d
		}
	}
	return best
}

// editDistance is the Levenshtein distance of a and b (bytes).
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev = cur
	}
	return prev[len(b)]
}
