package auth

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"
	"github.com/natshard/natshard/protocol"
)

// Files of an auth directory. Seeds (.nk) and credentials (.creds) are
// secrets, written with mode 0600; the directory is 0700.
const (
	FileOperatorJWT  = "operator.jwt" // the operator, self-signed
	FileOperatorSeed = "operator.nk"  // signs accounts: the root of trust
	FileAccountJWT   = "account.jwt"  // the natshard account, JetStream enabled
	FileAccountSeed  = "account.nk"   // signs users (auth user)
	FileSystemJWT    = "sys.jwt"      // the system account
	FileScope        = "scope.json"   // the Scope given to init: the default of AddUser
	FileServerConf   = "server.conf"  // configuration of an external nats-server
	credsSuffix      = ".creds"
	AccountName      = "natshard"
	systemName       = "SYS"
	operatorName     = "natshard"
	secretMode       = 0o600
	dirMode          = 0o700
	publicMode       = 0o644
)

// Errors of this package.
var (
	// ErrExists: Init or AddUser would overwrite keys or credentials.
	ErrExists = errors.New("auth: already exists")
	// ErrUnknownRole: a role that is not publisher, region or admin.
	ErrUnknownRole = errors.New("auth: unknown role")
	// ErrNotInitialized: the directory has no operator and account (run
	// shardctl auth init).
	ErrNotInitialized = errors.New("auth: directory not initialized")
)

// Setup is an initialized auth directory: the operator, the natshard
// account and the system account, as JWTs and public keys.
type Setup struct {
	Dir         string
	OperatorJWT string
	AccountJWT  string
	SystemJWT   string
	Account     string // public key of the natshard account
	System      string // public key of the system account
	Scope       Scope
}

// Init creates, in dir (created if needed), an operator, the natshard
// account with JetStream enabled (no limit on storage, streams or
// consumers: the server's own limits apply), a system account, and one
// user per role named after it (publisher.creds, region.creds,
// admin.creds), with permissions over scope. It also writes the
// configuration of an external nats-server (server.conf). It refuses to
// overwrite an existing setup (ErrExists).
func Init(dir string, scope Scope) (*Setup, error) {
	if _, err := scope.subjects(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, dirMode); err != nil {
		return nil, fmt.Errorf("auth: %w", err)
	}
	for _, f := range []string{FileOperatorJWT, FileOperatorSeed, FileAccountJWT, FileAccountSeed} {
		if _, err := os.Stat(filepath.Join(dir, f)); err == nil {
			return nil, fmt.Errorf("%w: %s in %s (keys are never overwritten; use another --dir)", ErrExists, f, dir)
		}
	}
	op, err := nkeys.CreateOperator()
	if err != nil {
		return nil, err
	}
	acc, err := nkeys.CreateAccount()
	if err != nil {
		return nil, err
	}
	sys, err := nkeys.CreateAccount()
	if err != nil {
		return nil, err
	}
	opPub, _ := op.PublicKey()
	accPub, _ := acc.PublicKey()
	sysPub, _ := sys.PublicKey()

	oc := jwt.NewOperatorClaims(opPub)
	oc.Name = operatorName
	oc.SystemAccount = sysPub
	opJWT, err := oc.Encode(op)
	if err != nil {
		return nil, fmt.Errorf("auth: operator JWT: %w", err)
	}
	ac := jwt.NewAccountClaims(accPub)
	ac.Name = AccountName
	ac.Limits.JetStreamLimits = jwt.JetStreamLimits{
		MemoryStorage: jwt.NoLimit, DiskStorage: jwt.NoLimit, Streams: jwt.NoLimit, Consumer: jwt.NoLimit,
	}
	accJWT, err := ac.Encode(op)
	if err != nil {
		return nil, fmt.Errorf("auth: account JWT: %w", err)
	}
	sc := jwt.NewAccountClaims(sysPub)
	sc.Name = systemName
	sysJWT, err := sc.Encode(op)
	if err != nil {
		return nil, fmt.Errorf("auth: system account JWT: %w", err)
	}
	opSeed, _ := op.Seed()
	accSeed, _ := acc.Seed()
	scopeJSON, _ := json.MarshalIndent(scope, "", "  ")
	st := &Setup{Dir: dir, OperatorJWT: opJWT, AccountJWT: accJWT, SystemJWT: sysJWT, Account: accPub, System: sysPub, Scope: scope}
	type file struct {
		name string
		data []byte
		mode os.FileMode
	}
	// Each role's user first: one that cannot be made (its JWT too
	// large) refuses the setup before anything is written.
	var users []file
	for _, r := range Roles {
		creds, err := userCreds(acc, r, string(r), scope)
		if err != nil {
			return nil, err
		}
		users = append(users, file{string(r) + credsSuffix, creds, secretMode})
	}
	for _, f := range append([]file{
		{FileOperatorSeed, opSeed, secretMode},
		{FileAccountSeed, accSeed, secretMode},
		{FileOperatorJWT, []byte(opJWT), publicMode},
		{FileAccountJWT, []byte(accJWT), publicMode},
		{FileSystemJWT, []byte(sysJWT), publicMode},
		{FileScope, append(scopeJSON, '\n'), publicMode},
		{FileServerConf, []byte(st.ServerConfig()), publicMode},
	}, users...) {
		if err := writeNew(filepath.Join(dir, f.name), f.data, f.mode); err != nil {
			return nil, err
		}
	}
	return st, nil
}

// Load reads the setup of an initialized directory.
func Load(dir string) (*Setup, error) {
	read := func(name string) (string, error) {
		data, err := os.ReadFile(filepath.Join(dir, name))
		if errors.Is(err, fs.ErrNotExist) {
			return "", fmt.Errorf("%w: %s has no %s (run shardctl auth init --dir %s)", ErrNotInitialized, dir, name, dir)
		}
		return strings.TrimSpace(string(data)), err
	}
	st := &Setup{Dir: dir}
	var err error
	if st.OperatorJWT, err = read(FileOperatorJWT); err != nil {
		return nil, err
	}
	if st.AccountJWT, err = read(FileAccountJWT); err != nil {
		return nil, err
	}
	if st.SystemJWT, err = read(FileSystemJWT); err != nil {
		return nil, err
	}
	ac, err := jwt.DecodeAccountClaims(st.AccountJWT)
	if err != nil {
		return nil, fmt.Errorf("auth: %s: %w", FileAccountJWT, err)
	}
	sc, err := jwt.DecodeAccountClaims(st.SystemJWT)
	if err != nil {
		return nil, fmt.Errorf("auth: %s: %w", FileSystemJWT, err)
	}
	st.Account, st.System = ac.Subject, sc.Subject
	scope, err := read(FileScope)
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal([]byte(scope), &st.Scope); err != nil {
		return nil, fmt.Errorf("auth: %s: %w", FileScope, err)
	}
	return st, nil
}

// AddUser creates the credentials of a new user name in role over scope
// (the scope given to Init when scope has no type), signed by the
// account's key, as <dir>/<name>.creds, and returns the file's path. It
// refuses to overwrite existing credentials (ErrExists).
func AddUser(dir string, role Role, name string, scope Scope) (string, error) {
	if _, err := ParseRole(string(role)); err != nil {
		return "", err
	}
	if err := protocol.ValidateName("user name", name); err != nil {
		return "", err
	}
	if len(scope.Types) == 0 {
		st, err := Load(dir)
		if err != nil {
			return "", err
		}
		scope = st.Scope
	}
	path := filepath.Join(dir, name+credsSuffix)
	if _, err := os.Stat(path); err == nil {
		return "", fmt.Errorf("%w: %s", ErrExists, path)
	}
	seed, err := os.ReadFile(filepath.Join(dir, FileAccountSeed))
	if errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("%w: %s has no %s (run shardctl auth init --dir %s)", ErrNotInitialized, dir, FileAccountSeed, dir)
	}
	if err != nil {
		return "", fmt.Errorf("auth: %w", err)
	}
	acc, err := nkeys.FromSeed([]byte(strings.TrimSpace(string(seed))))
	if err != nil {
		return "", fmt.Errorf("auth: %s: %w", FileAccountSeed, err)
	}
	creds, err := userCreds(acc, role, name, scope)
	if err != nil {
		return "", err
	}
	return path, writeNew(path, creds, secretMode)
}

// userCreds makes the credentials (JWT and seed) of a new user name in
// role over scope, signed by the account key acc. A JWT that could not
// travel in a CONNECT line is refused: past the server's max_control_line
// the server drops the connection ("maximum control line exceeded"), so
// it is refused here, where the cause can be named.
func userCreds(acc nkeys.KeyPair, role Role, name string, scope Scope) ([]byte, error) {
	perms, err := Permissions(role, name, scope)
	if err != nil {
		return nil, err
	}
	user, err := nkeys.CreateUser()
	if err != nil {
		return nil, err
	}
	userPub, _ := user.PublicKey()
	uc := jwt.NewUserClaims(userPub)
	uc.Name = name
	uc.Permissions = perms
	uc.Tags.Add(roleTag + string(role))
	token, err := uc.Encode(acc)
	if err != nil {
		return nil, fmt.Errorf("auth: user JWT: %w", err)
	}
	if len(token)+connectOverhead > MaxControlLine {
		return nil, fmt.Errorf("auth: the %s user %q would carry a JWT of %d bytes, more than a CONNECT line may (max_control_line %d, which the setup's servers use): give it fewer types (%d in its scope; each takes about 11 KB of a region user's JWT, so 5 fit), one user per few types", role, name, len(token), MaxControlLine, len(scope.Types))
	}
	userSeed, _ := user.Seed()
	return jwt.FormatUserConfig(token, userSeed)
}

// connectOverhead bounds what a CONNECT line holds besides the user's JWT:
// the nonce's signature, the client's name, version and options.
const connectOverhead = 2 << 10

// writeNew writes a file that must not exist yet.
func writeNew(path string, data []byte, mode os.FileMode) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("%w: %s", ErrExists, path)
	}
	if err != nil {
		return fmt.Errorf("auth: %w", err)
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return fmt.Errorf("auth: %w", err)
	}
	return f.Close()
}
