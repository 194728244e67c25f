package auth

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
)

// Client says how a natshard process authenticates to NATS: a credentials
// file (a user JWT and its seed), and TLS files. Every field is optional.
type Client struct {
	Creds   string // --creds
	TLSCert string // --tls-cert: client certificate, with TLSKey
	TLSKey  string // --tls-key
	TLSCA   string // --tls-ca: CA certificates that sign the server's
}

// Validate checks that the files exist and go together. It names the
// flag at fault.
func (c Client) Validate() error {
	var errs []error
	if (c.TLSCert == "") != (c.TLSKey == "") {
		errs = append(errs, errors.New("--tls-cert and --tls-key: give both or neither"))
	}
	for _, f := range []struct{ flag, path string }{{"--creds", c.Creds}, {"--tls-cert", c.TLSCert}, {"--tls-key", c.TLSKey}, {"--tls-ca", c.TLSCA}} {
		if f.path == "" {
			continue
		}
		if _, err := os.Stat(f.path); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", f.flag, err))
		}
	}
	return errors.Join(errs...)
}

// Options returns the nats.go options for c. With credentials whose
// permissions restrict their user to a private inbox prefix (region and
// admin users, see InboxPrefix), the connection uses that prefix for
// every reply subject, so that its requests get their answers.
func (c Client) Options() ([]nats.Option, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	var opts []nats.Option
	if c.Creds != "" {
		uc, err := readUser(c.Creds)
		if err != nil {
			return nil, err
		}
		opts = append(opts, nats.UserCredentials(c.Creds))
		if p := inboxOf(uc.Permissions); p != "" {
			opts = append(opts, nats.CustomInboxPrefix(p))
		}
	}
	if c.TLSCert != "" {
		opts = append(opts, nats.ClientCert(c.TLSCert, c.TLSKey))
	}
	if c.TLSCA != "" {
		opts = append(opts, nats.RootCAs(c.TLSCA))
	}
	return opts, nil
}

// roleTag is the JWT tag that names a user's role: natshard-role:<role>.
const roleTag = "natshard-role:"

// User reads the user of a credentials file: its name, and its role when
// AddUser made it (its JWT carries the role as a tag); "" for a user made
// otherwise. Tools use it to say which role a refused operation needs.
func User(creds string) (name string, role Role, err error) {
	uc, err := readUser(creds)
	if err != nil {
		return "", "", err
	}
	for _, t := range uc.Tags {
		if r, ok := strings.CutPrefix(t, roleTag); ok {
			role = Role(r)
		}
	}
	return uc.Name, role, nil
}

// readUser reads and checks a credentials file: a user JWT and its seed.
func readUser(creds string) (*jwt.UserClaims, error) {
	data, err := os.ReadFile(creds)
	if err != nil {
		return nil, fmt.Errorf("--creds: %w", err)
	}
	token, err := jwt.ParseDecoratedJWT(data)
	if err != nil {
		return nil, fmt.Errorf("--creds: %s is not a credentials file: %w", creds, err)
	}
	uc, err := jwt.DecodeUserClaims(token)
	if err != nil {
		return nil, fmt.Errorf("--creds: %s holds no user JWT: %w", creds, err)
	}
	if _, err := jwt.ParseDecoratedUserNKey(data); err != nil {
		return nil, fmt.Errorf("--creds: %s holds no user seed: %w", creds, err)
	}
	return uc, nil
}
