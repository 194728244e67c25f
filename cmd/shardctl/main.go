// Command shardctl inspects a natshard type, talks to its entities and
// tells its coordinator what to do.
//
//	shardctl [global flags] <command> [args] [flags]
//
// The commands are listed, with their help and examples, in commands.go;
// `shardctl help` prints them. Each has a file of its own (status.go,
// move.go, ...); bench (bench.go: its flags and its tables; what it measures
// is internal/benchlab) and auth (auth.go) parse their own flags.
// A payload of "-" is read from standard input. Exit status: 0 ok (help
// included), 1 the operation failed, 2 a bad command line.
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
	"time"

	"github.com/natshard/natshard/auth"
	"github.com/natshard/natshard/internal/benchlab"
	"github.com/natshard/natshard/internal/version"
	"github.com/natshard/natshard/protocol"
)

// errUsage marks errors in the command line (exit status 2).
var errUsage = errors.New("usage")

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdin, os.Stdout, os.Stderr)
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, errorLine(err))
	}
	os.Exit(exitCode(err))
}

// errorLine is how shardctl prints an error: its text may hold what the
// network sent (a refusal, an entity's error), so control characters are
// escaped.
func errorLine(err error) string { return "shardctl: " + cleanText(err.Error()) }

// exitCode is the exit status for what run returned: 0 ok (or --help), 2
// a bad command line (bench's flags are checked by benchlab), 1 anything
// else.
func exitCode(err error) int {
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, errUsage), errors.Is(err, benchlab.ErrUsage):
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
	Version       bool
	Auth          auth.Client // --creds, --tls-*
	// Flags of single commands.
	DryRun bool   // rebalance
	Count  int    // watch
	Limit  int    // region, shard
	Wait   bool   // move, drain, undrain, rebalance
	Key    string // send, request: the idempotency key (Nats-Msg-Id)
	Shards int    // reshard: the shard count to split to
	// Command is the command being run, for error messages.
	Command string
}

// Defaults of --timeout: each NATS operation, and with --wait the whole
// command.
const (
	defaultTimeout     = 5 * time.Second
	defaultWaitTimeout = time.Minute
)

// newFlagSet returns shardctl's flags, bound to o. Every command's own
// flags are in it too (a command refuses those of others), so that they
// may stand anywhere on the command line. It prints nothing: run reports
// errors, and help is printed on request.
func newFlagSet(o *options, getenv func(string) string) *flag.FlagSet {
	fs := flag.NewFlagSet("shardctl", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	url := getenv("NATS_URL")
	if url == "" {
		url = "nats://127.0.0.1:4222"
	}
	fs.StringVar(&o.NATS, "nats", url, "NATS server `URL`s, comma-separated [NATS_URL]")
	fs.StringVar(&o.Type, "type", "kv", "entity type `name`")
	fs.StringVar(&o.DataPrefix, "data-prefix", "", "subject `prefix` of the data plane (default shard)")
	fs.StringVar(&o.ControlPrefix, "control-prefix", "", "subject `prefix` of the control plane (default $SHARD)")
	fs.StringVar(&o.Auth.Creds, "creds", getenv("NATS_CREDS"), "NATS credentials `file` (shardctl auth) [NATS_CREDS]")
	fs.StringVar(&o.Auth.TLSCert, "tls-cert", getenv("NATS_CERT"), "TLS client certificate `file` [NATS_CERT]")
	fs.StringVar(&o.Auth.TLSKey, "tls-key", getenv("NATS_KEY"), "TLS client key `file` [NATS_KEY]")
	fs.StringVar(&o.Auth.TLSCA, "tls-ca", getenv("NATS_CA"), "`file` of the CA certificates that sign the server's [NATS_CA]")
	fs.DurationVar(&o.Timeout, "timeout", defaultTimeout, "bound on each NATS operation (default 5s), and with --wait on the whole command (default 1m then)")
	fs.BoolVar(&o.JSON, "json", false, "print JSON instead of a table")
	fs.BoolVar(&o.Version, "version", false, "print shardctl's version and VCS revision")
	fs.BoolVar(&o.DryRun, "dry-run", false, "print the plan, move nothing")
	fs.IntVar(&o.Count, "count", 0, "stop after `N` events (0: until interrupted)")
	fs.IntVar(&o.Limit, "limit", protocol.DefaultEntityLimit, "list at most `N` entity ids")
	fs.StringVar(&o.Key, "key", "", "idempotency `key` of the message (its Nats-Msg-Id): sent again with it, it is applied once and answered as the first time")
	fs.BoolVar(&o.Wait, "wait", false, "wait until it is done, printing progress on stderr; bounded by --timeout")
	fs.IntVar(&o.Shards, "shards", 0, "the type's new shard `count`: a multiple of today's")
	return fs
}

func run(ctx context.Context, args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) error {
	var o options
	fs := newFlagSet(&o, getenv)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return printHelp(stdout, fs)
		}
		return flagErr(err)
	}
	rest := fs.Args()
	if o.Version {
		_, err := fmt.Fprintln(stdout, version.String("shardctl"))
		return err
	}
	if len(rest) == 0 {
		printHelp(stderr, fs)
		return fmt.Errorf("%w: no command given", errUsage)
	}
	cmd, err := lookup(rest[0])
	if err != nil {
		return err
	}
	o.Command = cmd.name
	if cmd.local != nil {
		return cmd.local(ctx, local{o: o, fs: fs, stdout: stdout, stderr: stderr}, rest[1:])
	}
	// Flags may also follow the command: shardctl shards --json.
	cargs, err := parseInterleaved(fs, rest[1:])
	if errors.Is(err, flag.ErrHelp) {
		return printCommandHelp(stdout, fs, cmd)
	}
	if err != nil {
		return err
	}
	if o.Version {
		_, err := fmt.Fprintln(stdout, version.String("shardctl"))
		return err
	}
	if len(cargs) != cmd.nargs {
		return fmt.Errorf("%w: %s takes %d argument(s): shardctl %s %s", errUsage, cmd.name, cmd.nargs, cmd.name, cmd.args)
	}
	if err := checkFlags(fs, cmd, &o); err != nil {
		return err
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
	if o.Wait {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, o.Timeout)
		defer cancel()
	}
	c, err := dial(ctx, o)
	if err != nil {
		return err
	}
	defer c.Close()
	c.stderr = stderr
	err = cmd.run(ctx, c, cargs, stdout)
	// The server reports what it refused asynchronously: whatever the
	// command made of it, a refusal is the cause to name.
	if denied := c.deniedAfterFlush(); denied != nil {
		return denied
	}
	return err
}

// checkFlags refuses flags of other commands and values out of range, and
// sets the --timeout of a command that waits.
func checkFlags(fs *flag.FlagSet, cmd *command, o *options) error {
	var misplaced error
	timeoutGiven := false
	fs.Visit(func(f *flag.Flag) {
		timeoutGiven = timeoutGiven || f.Name == "timeout"
		if slices.Contains(commandFlags(), f.Name) && !slices.Contains(cmd.flags, f.Name) {
			misplaced = fmt.Errorf("%w: --%s is not a flag of %s (shardctl help %s)", errUsage, f.Name, cmd.name, cmd.name)
		}
	})
	switch {
	case misplaced != nil:
		return misplaced
	case o.Timeout <= 0:
		return fmt.Errorf("%w: --timeout must be positive", errUsage)
	case o.Count < 0 || o.Limit < 1 || o.Limit > protocol.MaxEntityLimit:
		return fmt.Errorf("%w: --count must be 0 or more, --limit 1..%d", errUsage, protocol.MaxEntityLimit)
	case o.Wait && o.DryRun:
		return fmt.Errorf("%w: --wait and --dry-run: a dry run moves nothing to wait for", errUsage)
	}
	if (o.Wait || cmd.name == "reshard") && !timeoutGiven {
		o.Timeout = defaultWaitTimeout
	}
	if cmd.name == "reshard" {
		o.Wait = true // bounded as a wait is
		if o.Shards < 1 || o.Shards > protocol.MaxShards {
			return fmt.Errorf("%w: reshard needs --shards N, the new count (1..%d, a multiple of today's)", errUsage, protocol.MaxShards)
		}
	}
	return nil
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
	return fmt.Errorf("%w: %w (shardctl help)", errUsage, err)
}
