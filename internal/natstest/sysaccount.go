package natstest

import "github.com/nats-io/nats-server/v2/server"

// System account user of WithSystemAccount.
const (
	SystemUser     = "sys"
	SystemPassword = "sys"
)

// WithSystemAccount gives opts a system account (SYS) with a user
// (SystemUser, SystemPassword) that can read the servers' advisories, such
// as $SYS.ACCOUNT.*.DISCONNECT; clients that connect without credentials
// land in the global account as before (NoAuthUser), with JetStream.
func WithSystemAccount(opts *server.Options) *server.Options {
	sys := server.NewAccount("SYS")
	opts.Accounts = []*server.Account{sys}
	opts.SystemAccount = sys.Name
	opts.Users = []*server.User{
		{Username: SystemUser, Password: SystemPassword, Account: sys},
		{Username: "app", Password: "app"}, // the global account
	}
	opts.NoAuthUser = "app"
	return opts
}
