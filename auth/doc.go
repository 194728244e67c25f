// Package auth secures natshard with NATS's own decentralized
// authentication: an operator, one account for natshard (JetStream
// enabled) and users whose JWTs, signed by the account's key, carry
// least-privilege permissions for one of three roles (Publisher, Region,
// Admin) over a Scope of entity types.
//
// Permissions are derived from protocol.Subjects and kvstate's bucket and
// stream names, so they follow the subjects natshard really uses; the
// server enforces them, natshard's code is not trusted to.
//
//	st, err := auth.Init(dir, auth.Scope{Types: []string{"orders"}}) // operator, accounts, three users
//	path, err := auth.AddUser(dir, auth.Publisher, "web", auth.Scope{}) // one more user, init's scope
//	err = st.ConfigureServer(opts)                                    // an embedded server in operator mode
//	nopts, err := auth.Client{Creds: path}.Options()                  // a client of it
//
// docs/SECURITY.md lists each role's permissions and the threat model.
package auth
