package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"path/filepath"
	"strings"

	"github.com/natshard/natshard/auth"
)

// defaultAuthDir is where auth init writes when --dir is not given.
const defaultAuthDir = "natshard-auth"

// authHelp and authExamples are auth's help (shardctl help auth).
const authHelp = `Creates the keys and credentials of NATS's decentralized authentication
for natshard (docs/SECURITY.md), without a NATS connection:

  shardctl auth init [--dir D] [--types T1,T2]
      create an operator, the natshard account (JetStream enabled) and one
      user per role: D/publisher.creds, D/region.creds, D/admin.creds; print
      the configuration of an external nats-server (also in D/server.conf)
  shardctl auth user <publisher|region|admin> <name> [--dir D] [--types T1,T2]
      create D/<name>.creds for one more user (types: those of auth init)

  --dir D          directory of the keys and credentials (default natshard-auth)
  --types T1,T2    entity types the users may use (default --type; for auth
                   user, those of auth init)

Run shardd --auth-dir D for an embedded server in operator mode, or
shardd/shardctl --creds F against any NATS server.`

const authExamples = `shardctl auth init --dir ./natshard-auth --types orders,payments
# One more publisher, for the web front end.
shardctl auth user publisher web --dir ./natshard-auth
shardctl --creds ./natshard-auth/admin.creds status`

// localAuth is shardctl auth.
func localAuth(_ context.Context, l local, args []string) error {
	return cmdAuth(l, args)
}

// cmdAuth runs shardctl auth: key and credential files, no NATS connection.
func cmdAuth(l local, args []string) error {
	o, stdout := l.o, l.stdout
	fs := flag.NewFlagSet("shardctl auth", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	dir := fs.String("dir", defaultAuthDir, "directory of the keys and credentials")
	types := fs.String("types", "", "entity types the users may use, comma-separated (default --type; for auth user, those of auth init)")
	if wantsHelp(args) {
		c, _ := lookup("auth")
		return printCommandHelp(stdout, l.fs, c)
	}
	if len(args) == 0 {
		return fmt.Errorf("%w: auth needs init or user (shardctl help auth)", errUsage)
	}
	sub := args[0]
	pos, err := parseInterleaved(fs, args[1:])
	if err != nil {
		return err
	}
	scope := auth.Scope{DataPrefix: o.DataPrefix, ControlPrefix: o.ControlPrefix}
	if *types != "" {
		scope.Types = strings.Split(*types, ",")
	}
	switch sub {
	case "init":
		if len(pos) != 0 {
			return fmt.Errorf("%w: auth init takes no argument: shardctl auth init [--dir D] [--types T1,T2]", errUsage)
		}
		if len(scope.Types) == 0 {
			scope.Types = []string{o.Type}
		}
		st, err := auth.Init(*dir, scope)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "operator, account %s (JetStream enabled) and system account written to %s\n", auth.AccountName, *dir)
		fmt.Fprintf(stdout, "types: %s\n", strings.Join(scope.Types, ", "))
		for _, r := range auth.Roles {
			fmt.Fprintf(stdout, "%-9s %s\n", r, filepath.Join(*dir, string(r)+".creds"))
		}
		fmt.Fprintf(stdout, "\nembedded NATS:  shardd --auth-dir %s\n", *dir)
		fmt.Fprintf(stdout, "external NATS:  nats-server -c %s   (then shardd --creds %s)\n", filepath.Join(*dir, auth.FileServerConf), filepath.Join(*dir, "region.creds"))
		fmt.Fprintf(stdout, "shardctl:       shardctl --creds %s status\n", filepath.Join(*dir, "admin.creds"))
		fmt.Fprintf(stdout, "\n%s", st.ServerConfig())
		return nil
	case "user":
		if len(pos) != 2 {
			return fmt.Errorf("%w: auth user takes a role and a name: shardctl auth user <publisher|region|admin> <name>", errUsage)
		}
		role, err := auth.ParseRole(pos[0])
		if err != nil {
			return fmt.Errorf("%w: %w", errUsage, err)
		}
		path, err := auth.AddUser(*dir, role, pos[1], scope)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "%s %s: %s\n", role, pos[1], path)
		return nil
	}
	return fmt.Errorf("%w: unknown auth command %q (init, user; shardctl help auth)", errUsage, sub)
}
