package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
)

// Help goes to stdout (shardctl help, --help, <command> --help), as
// kubectl and the nats CLI do; only the help printed for a missing command
// goes to stderr.

const about = `shardctl inspects a natshard entity type, talks to its entities and tells
its coordinator what to do, over NATS (docs/API.md: every command is an
admin request, a region query or an event any NATS client can use).`

// printHelp prints the top-level help: the commands by group, examples
// and the global flags.
func printHelp(out io.Writer, fs *flag.FlagSet) error {
	fmt.Fprintf(out, "%s\n\nUsage:\n  shardctl [global flags] <command> [args] [flags]\n", about)
	for _, g := range groups {
		fmt.Fprintf(out, "\n%s:\n", g)
		tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
		for _, c := range commands {
			if c.group == g {
				fmt.Fprintf(tw, "  %s\t%s\n", strings.TrimSpace(c.name+" "+c.args), c.short)
			}
		}
		tw.Flush()
	}
	fmt.Fprint(out, `
Examples:
  shardctl status
  shardctl --nats nats://n1:4222 --creds admin.creds drain c --wait
  shardctl move 17 b --wait --timeout 30s

Global flags:
`)
	printFlags(out, fs, globalFlags(fs))
	_, err := fmt.Fprint(out, `
Run 'shardctl help <command>' or 'shardctl <command> --help' for what a
command does, its flags and examples.
`)
	return err
}

// printCommandHelp prints a command's help: what it does, its usage,
// examples and own flags.
func printCommandHelp(out io.Writer, fs *flag.FlagSet, c *command) error {
	fmt.Fprintf(out, "shardctl %s: %s\n\nUsage:\n  shardctl [global flags] %s\n", c.name, c.short, strings.TrimSpace(c.name+" "+c.args))
	if c.long != "" {
		fmt.Fprintf(out, "\n%s\n", c.long)
	}
	fmt.Fprint(out, "\nExamples:\n")
	for _, l := range strings.Split(c.examples, "\n") {
		fmt.Fprintf(out, "  %s\n", l)
	}
	if len(c.flags) > 0 {
		fmt.Fprint(out, "\nFlags:\n")
		printFlags(out, fs, c.flags)
	}
	if c.run != nil {
		var names []string
		for _, name := range globalFlags(fs) {
			names = append(names, "--"+name)
		}
		fmt.Fprintf(out, "\nGlobal flags (shardctl help describes them):\n  %s\n", strings.Join(names, " "))
	}
	return nil
}

// globalFlags are the names of the flags of every command.
func globalFlags(fs *flag.FlagSet) []string {
	var names []string
	fs.VisitAll(func(f *flag.Flag) {
		if !slices.Contains(commandFlags(), f.Name) {
			names = append(names, f.Name)
		}
	})
	return names
}

// printFlags prints the named flags of fs, one per line.
func printFlags(out io.Writer, fs *flag.FlagSet, names []string) {
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	for _, name := range names {
		f := fs.Lookup(name)
		typ, usage := flag.UnquoteUsage(f)
		spec := "--" + f.Name
		if typ != "" {
			spec += " " + typ
		}
		if f.DefValue != "" && f.DefValue != "false" && f.DefValue != "0" && !strings.Contains(usage, "(default") {
			usage += fmt.Sprintf(" (default %s)", f.DefValue)
		}
		fmt.Fprintf(tw, "  %s\t%s\n", spec, usage)
	}
	tw.Flush()
}

// localHelp is shardctl help [command].
func localHelp(_ context.Context, l local, args []string) error {
	switch {
	case len(args) == 0:
		return printHelp(l.stdout, l.fs)
	case len(args) > 1:
		return fmt.Errorf("%w: help takes at most one command: shardctl help [command]", errUsage)
	case args[0] == "-h" || args[0] == "--help" || args[0] == "-help":
		args[0] = "help"
	}
	c, err := lookup(args[0])
	if err != nil {
		return err
	}
	if c.name == "bench" {
		return benchHelp(l)
	}
	return printCommandHelp(l.stdout, l.fs, c)
}

// wantsHelp reports whether args ask for help (-h, --help) before "--".
func wantsHelp(args []string) bool {
	for _, a := range args {
		switch a {
		case "--":
			return false
		case "-h", "-help", "--h", "--help":
			return true
		}
	}
	return false
}

// localBench is shardctl bench: its help (bench --help) goes to stdout,
// with examples, like every command's.
func localBench(ctx context.Context, l local, args []string) error {
	if wantsHelp(args) {
		return benchHelp(l)
	}
	return runBench(ctx, l.fs, args, l.stdout, l.stderr)
}

func benchHelp(l local) error {
	c, _ := lookup("bench")
	fmt.Fprintf(l.stdout, "shardctl bench: %s\n\n%s\n\nExamples:\n", c.short, c.long)
	for _, line := range strings.Split(c.examples, "\n") {
		fmt.Fprintf(l.stdout, "  %s\n", line)
	}
	fmt.Fprintln(l.stdout)
	if err := runBench(context.Background(), l.fs, []string{"--help"}, l.stdout, l.stdout); !errors.Is(err, flag.ErrHelp) {
		return err
	}
	return nil
}
