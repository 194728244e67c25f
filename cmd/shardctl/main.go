// Command shardctl inspects a natshard type, talks to its entities and
// tells its coordinator what to do.
//
//	shardctl [--nats URL] [--type T] <command> [args] [--json]
//
// Commands: status, regions, region <id>, shards, shard <n>, locate
// <entity>, stats, send <entity> <payload>, request <entity> <payload>,
// move <shard> <region>, drain <region>, pin <shard> <region>, unpin
// <shard>, rebalance [--dry-run], watch [--count N], bench [flags] (see
// bench.go), and auth init|user (keys and credentials, see auth.go). A
// payload of "-" is read from standard input. Exit status: 0 ok, 1 the
// operation failed, 2
// a bad command line.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strings"
	"time"

	"github.com/natshard/natshard/auth"
	"github.com/natshard/natshard/protocol"
)

// errUsage marks errors in the command line (exit status 2).
var errUsage = errors.New("usage")

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdin, os.Stdout, os.Stderr)
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "shardctl:", err)
	}
	os.Exit(exitCode(err))
}

// exitCode is the exit status for what run returned: 0 ok (or --help), 2
// a bad command line, 1 anything else.
func exitCode(err error) int {
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, errUsage):
		return 2
	}
	return 1
}

// options are the flags every command takes.
type options struct {
	NATS          string
	Type          string
	DataPrefix    string
	ControlPrefix string
	Timeout       time.Duration
	JSON          bool
	Auth          auth.Client // --creds, --tls-*
	// Flags of single commands.
	DryRun bool // rebalance
	Count  int  // watch
	Limit  int  // region, shard
}

type command struct {
	name, args, help string
	nargs            int
	run              func(ctx context.Context, c *client, args []string, out io.Writer) error
	flags            []string // the command's own flags
}

var commands = []command{
	{"status", "", "coordinator, epoch, regions, shards allocated and unowned", 0, cmdStatus, nil},
	{"regions", "", "the registered regions and how many shards each holds", 0, cmdRegions, nil},
	{"region", "<id> [--limit N]", "a region's shards and their entity ids", 1, cmdRegion, []string{"limit"}},
	{"shards", "", "every shard with its region, state and pin", 0, cmdShards, nil},
	{"shard", "<n> [--limit N]", "a shard's owner, state, pin and entity ids", 1, cmdShard, []string{"limit"}},
	{"locate", "<entity>", "the shard, subject and owner of an entity", 1, cmdLocate, nil},
	{"stats", "", "per region and shard: entities, buffered messages, messages/s", 0, cmdStats, nil},
	{"send", "<entity> <payload>", "publish a message to an entity", 2, cmdSend, nil},
	{"request", "<entity> <payload>", "send a request to an entity and print the answer", 2, cmdRequest, nil},
	{"move", "<shard> <region>", "hand a shard off to a region", 2, cmdMove, nil},
	{"drain", "<region>", "hand every shard of a region off and give it no more", 1, cmdDrain, nil},
	{"pin", "<shard> <region>", "keep a shard on a region (moved there by the next round)", 2, cmdPin, nil},
	{"unpin", "<shard>", "remove a shard's pin", 1, cmdUnpin, nil},
	{"rebalance", "[--dry-run]", "run a strategy round now (--dry-run: print the plan only)", 0, cmdRebalance, []string{"dry-run"}},
	{"watch", "[--count N]", "print allocations and handoffs as they happen (N events, or until interrupted)", 0, cmdWatch, []string{"count"}},
	{"bench", "[flags]", "throughput and latency through entities beside raw NATS (bench --help)", 0, nil, nil},
}

// commandNames lists the commands, for error messages.
func commandNames() string {
	names := make([]string, len(commands))
	for i, c := range commands {
		names[i] = c.name
	}
	return strings.Join(names, ", ")
}

func run(ctx context.Context, args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) error {
	var o options
	fs := flag.NewFlagSet("shardctl", flag.ContinueOnError)
	fs.SetOutput(stderr)
	url := getenv("NATS_URL")
	if url == "" {
		url = "nats://127.0.0.1:4222"
	}
	fs.StringVar(&o.NATS, "nats", url, "NATS server URL(s) [NATS_URL]")
	fs.StringVar(&o.Type, "type", "kv", "entity type")
	fs.StringVar(&o.DataPrefix, "data-prefix", "", "subject prefix of the data plane (default shard)")
	fs.StringVar(&o.ControlPrefix, "control-prefix", "", "subject prefix of the control plane (default $SHARD)")
	fs.StringVar(&o.Auth.Creds, "creds", getenv("NATS_CREDS"), "NATS credentials file (shardctl auth) [NATS_CREDS]")
	fs.StringVar(&o.Auth.TLSCert, "tls-cert", getenv("NATS_CERT"), "TLS client certificate [NATS_CERT]")
	fs.StringVar(&o.Auth.TLSKey, "tls-key", getenv("NATS_KEY"), "TLS client key [NATS_KEY]")
	fs.StringVar(&o.Auth.TLSCA, "tls-ca", getenv("NATS_CA"), "CA certificates that sign the server's [NATS_CA]")
	fs.DurationVar(&o.Timeout, "timeout", 5*time.Second, "bound on each NATS operation")
	fs.BoolVar(&o.JSON, "json", false, "print JSON instead of a table")
	fs.BoolVar(&o.DryRun, "dry-run", false, "rebalance: print the plan, move nothing")
	fs.IntVar(&o.Count, "count", 0, "watch: stop after this many events (0: until interrupted)")
	fs.IntVar(&o.Limit, "limit", protocol.DefaultEntityLimit, "region, shard: most entity ids to list")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: shardctl [flags] <command> [args] [--json]\n\nCommands:\n")
		for _, c := range commands {
			fmt.Fprintf(stderr, "  %-34s %s\n", c.name+" "+c.args, c.help)
		}
		fmt.Fprintf(stderr, "  %-34s %s\n", "auth init|user ...", "create keys and credentials (shardctl auth --help)")
		fmt.Fprintf(stderr, "\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return flagErr(err)
	}
	rest := fs.Args()
	if len(rest) == 0 {
		fs.Usage()
		return fmt.Errorf("%w: no command given", errUsage)
	}
	if rest[0] == "bench" {
		return runBench(ctx, fs, rest[1:], stdout, stderr)
	}
	if rest[0] == "auth" {
		return cmdAuth(o, rest[1:], stdout, stderr)
	}
	var cmd *command
	for i := range commands {
		if commands[i].name == rest[0] {
			cmd = &commands[i]
		}
	}
	if cmd == nil {
		return fmt.Errorf("%w: unknown command %q (commands: %s)", errUsage, rest[0], commandNames())
	}
	// Flags may also follow the command: shardctl shards --json.
	cargs, err := parseInterleaved(fs, rest[1:])
	if err != nil {
		return err
	}
	if len(cargs) != cmd.nargs {
		return fmt.Errorf("%w: %s takes %d argument(s): shardctl %s %s", errUsage, cmd.name, cmd.nargs, cmd.name, cmd.args)
	}
	if o.Timeout <= 0 {
		return fmt.Errorf("%w: --timeout must be positive", errUsage)
	}
	var misplaced error
	fs.Visit(func(f *flag.Flag) {
		if slices.Contains([]string{"dry-run", "count", "limit"}, f.Name) && !slices.Contains(cmd.flags, f.Name) {
			misplaced = fmt.Errorf("%w: --%s is not a flag of %s", errUsage, f.Name, cmd.name)
		}
	})
	if misplaced != nil {
		return misplaced
	}
	if o.Count < 0 || o.Limit < 1 || o.Limit > protocol.MaxEntityLimit {
		return fmt.Errorf("%w: --count must be 0 or more, --limit 1..%d", errUsage, protocol.MaxEntityLimit)
	}
	for i, a := range cargs {
		if a == "-" {
			data, err := io.ReadAll(stdin)
			if err != nil {
				return err
			}
			cargs[i] = string(data)
		}
	}
	c, err := dial(ctx, o)
	if err != nil {
		return err
	}
	defer c.Close()
	c.stderr = stderr
	return cmd.run(ctx, c, cargs, stdout)
}

// parseInterleaved parses flags that may stand between positional
// arguments, and returns the positional ones. "--" ends the flags.
func parseInterleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, flagErr(err)
		}
		args = fs.Args()
		if len(args) == 0 {
			return pos, nil
		}
		if args[0] == "--" {
			return append(pos, args[1:]...), nil
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
}

// flagErr makes a flag parsing error a usage error (--help stays itself).
func flagErr(err error) error {
	if errors.Is(err, flag.ErrHelp) {
		return err
	}
	return fmt.Errorf("%w: %w", errUsage, err)
}
