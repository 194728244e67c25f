package auth

import (
	"fmt"
	"path/filepath"
	"strings"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
)

// ConfigureServer puts opts in operator mode with the setup: the operator
// is trusted, and a memory resolver holds the natshard and system
// accounts. Users are not known to the server: any user whose JWT the
// account's key signed can connect, with the permissions in its JWT.
func (st *Setup) ConfigureServer(opts *server.Options) error {
	oc, err := jwt.DecodeOperatorClaims(st.OperatorJWT)
	if err != nil {
		return fmt.Errorf("auth: %s: %w", FileOperatorJWT, err)
	}
	r := &server.MemAccResolver{}
	if err := r.Store(st.Account, st.AccountJWT); err != nil {
		return err
	}
	if err := r.Store(st.System, st.SystemJWT); err != nil {
		return err
	}
	opts.TrustedOperators = []*jwt.OperatorClaims{oc}
	opts.AccountResolver = r
	opts.SystemAccount = st.System
	// A region user's JWT, in its CONNECT, names every message stream a
	// type may have: more than the default 4 KiB of a control line.
	opts.MaxControlLine = max(opts.MaxControlLine, MaxControlLine)
	return nil
}

// MaxControlLine is the max_control_line a server needs for the users of
// the setup (ServerConfig and ConfigureServer set it): a region user's JWT,
// sent in its CONNECT line, names every message stream a durable type may
// have (natshard_msgs_<type> and ~0 to ~15), about 11 KB of JWT per
// type, more than nats-server's default of 4 KiB.
const MaxControlLine = 64 << 10

// ServerConfig is the configuration of an external nats-server that trusts
// the setup's operator, with a memory resolver preloaded with the accounts
// and JetStream enabled. Add the server's own settings (listen, TLS,
// cluster, store_dir) to it, or include it from the server's file.
func (st *Setup) ServerConfig() string {
	var b strings.Builder
	abs, err := filepath.Abs(st.Dir)
	if err != nil {
		abs = st.Dir
	}
	fmt.Fprintf(&b, "# natshard operator mode (shardctl auth init): nats-server -c %s\n", filepath.Join(abs, FileServerConf))
	fmt.Fprintf(&b, "operator: %q\n", filepath.Join(abs, FileOperatorJWT))
	fmt.Fprintf(&b, "system_account: %s\n", st.System)
	b.WriteString("resolver: MEMORY\n")
	b.WriteString("resolver_preload: {\n")
	fmt.Fprintf(&b, "  # account %s\n  %s: %q\n", AccountName, st.Account, st.AccountJWT)
	fmt.Fprintf(&b, "  # account %s\n  %s: %q\n", systemName, st.System, st.SystemJWT)
	b.WriteString("}\n")
	b.WriteString("jetstream: enabled\n")
	b.WriteString("# natshard needs short pings to notice dead clients (docs/OPERATIONS.md)\n")
	b.WriteString("ping_interval: \"2s\"\nping_max: 3\n")
	b.WriteString("# a region user's JWT, sent in its CONNECT line, names every message stream\n")
	b.WriteString("# a type may have (natshard_msgs_<type>~0 to ~15): more than the default 4 KiB\n")
	fmt.Fprintf(&b, "max_control_line: %d\n", MaxControlLine)
	return b.String()
}
