// Command shardctl inspects a natshard type and talks to its entities.
//
//	shardctl [--nats URL] [--type T] <command> [args] [--json]
//
// Commands: status, regions, shards, locate <entity>, send <entity>
// <payload>, request <entity> <payload>, move <shard> <region>, drain
// <region>. A payload of "-" is read from standard input.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"time"
)

// errUsage marks errors in the command line (exit status 2).
var errUsage = errors.New("usage")

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdin, os.Stdout, os.Stderr)
	switch {
	case err == nil:
	case errors.Is(err, flag.ErrHelp):
	case errors.Is(err, errUsage):
		fmt.Fprintln(os.Stderr, "shardctl:", err)
		os.Exit(2)
	default:
		fmt.Fprintln(os.Stderr, "shardctl:", err)
		os.Exit(1)
	}
}

// options are the flags every command takes.
type options struct {
	NATS          string
	Type          string
	DataPrefix    string
	ControlPrefix string
	Timeout       time.Duration
	JSON          bool
}

type command struct {
	name, args, help string
	nargs            int
	run              func(ctx context.Context, c *client, args []string, out io.Writer) error
}

var commands = []command{
	{"status", "", "coordinator, epoch, regions, shards allocated and unowned", 0, cmdStatus},
	{"regions", "", "the registered regions and how many shards each holds", 0, cmdRegions},
	{"shards", "", "every shard with its region and state", 0, cmdShards},
	{"locate", "<entity>", "the shard, subject and owner of an entity", 1, cmdLocate},
	{"send", "<entity> <payload>", "publish a message to an entity", 2, cmdSend},
	{"request", "<entity> <payload>", "send a request to an entity and print the answer", 2, cmdRequest},
	{"move", "<shard> <region>", "hand a shard off to a region", 2, cmdMove},
	{"drain", "<region>", "hand every shard of a region off and give it no more", 1, cmdDrain},
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
	fs.DurationVar(&o.Timeout, "timeout", 5*time.Second, "bound on each NATS operation")
	fs.BoolVar(&o.JSON, "json", false, "print JSON instead of a table")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: shardctl [flags] <command> [args] [--json]\n\nCommands:\n")
		for _, c := range commands {
			fmt.Fprintf(stderr, "  %-30s %s\n", c.name+" "+c.args, c.help)
		}
		fmt.Fprintf(stderr, "\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	rest := fs.Args()
	if len(rest) == 0 {
		fs.Usage()
		return fmt.Errorf("%w: no command given", errUsage)
	}
	var cmd *command
	for i := range commands {
		if commands[i].name == rest[0] {
			cmd = &commands[i]
		}
	}
	if cmd == nil {
		return fmt.Errorf("%w: unknown command %q (commands: status, regions, shards, locate, send, request, move, drain)", errUsage, rest[0])
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
	return cmd.run(ctx, c, cargs, stdout)
}

// parseInterleaved parses flags that may stand between positional
// arguments, and returns the positional ones. "--" ends the flags.
func parseInterleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
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
