package auth

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/nats-io/jwt/v2"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// Role is what a user may do. Every role is scoped to the types of a Scope.
type Role string

// Roles.
const (
	// Publisher publishes and sends requests to the entities of its types:
	// the data plane only, and its inbox for the answers.
	Publisher Role = "publisher"
	// Region is shardd: it hosts regions and is a coordinator candidate of
	// its types: their data plane, control plane, KV bucket and buffer
	// stream, nothing of other types.
	Region Role = "region"
	// Admin is shardctl: the admin API, region queries and events, reading
	// the KV bucket and the buffer lengths, and sending to entities. It
	// cannot write KV or the buffer, nor command regions.
	Admin Role = "admin"
)

// Roles lists the roles, in the order auth init creates them.
var Roles = []Role{Publisher, Region, Admin}

// ParseRole checks a role name.
func ParseRole(s string) (Role, error) {
	r := Role(s)
	if !slices.Contains(Roles, r) {
		return "", fmt.Errorf("%w: %q (roles: publisher, region, admin)", ErrUnknownRole, s)
	}
	return r, nil
}

// Scope is what permissions cover: entity types under subject prefixes
// (empty prefixes are the defaults).
type Scope struct {
	Types         []string `json:"types"`
	DataPrefix    string   `json:"data_prefix,omitempty"`
	ControlPrefix string   `json:"control_prefix,omitempty"`
}

// subjects returns the subjects of every type of the scope.
func (s Scope) subjects() ([]protocol.Subjects, error) {
	if len(s.Types) == 0 {
		return nil, errors.New("auth: a scope needs at least one type")
	}
	out := make([]protocol.Subjects, 0, len(s.Types))
	for _, t := range s.Types {
		subj, err := protocol.NewSubjects(s.DataPrefix, s.ControlPrefix, t)
		if err != nil {
			return nil, err
		}
		out = append(out, subj)
	}
	return out, nil
}

// InboxPrefix is the inbox prefix of the user name of a region or admin
// role: such users may subscribe to their own inboxes only
// (<prefix>.>), so that they read no one else's replies. ConnectOptions
// sets it on the connection.
//
// The prefixes share their first token, privilegedInboxes, so that a
// region may answer any of them (the answer to a durable request goes to
// the reply subject in its header, which the response permission does not
// cover), while publishers, who subscribe to _INBOX.>, read none.
func InboxPrefix(name string) string { return privilegedInboxes + "." + name }

// privilegedInboxes is the first token of the region and admin users'
// inboxes.
const privilegedInboxes = "_INBOX_natshard"

// publisherInbox is what publishers subscribe to for their answers: the
// default inbox prefix of every NATS client.
const publisherInbox = "_INBOX.>"

// jsAPI is the JetStream API prefix (no domain).
const jsAPI = "$JS.API."

// Permissions returns the permissions of user name in role over scope.
// Every subject comes from protocol.Subjects and kvstate's stream names,
// so permissions follow the subjects natshard really uses.
func Permissions(role Role, name string, scope Scope) (jwt.Permissions, error) {
	var p jwt.Permissions
	if err := protocol.ValidateName("user name", name); err != nil {
		return p, err
	}
	types, err := scope.subjects()
	if err != nil {
		return p, err
	}
	inbox := InboxPrefix(name) + ".>"
	for _, s := range types {
		kv := "KV_" + kvstate.BucketName(s.Type())
		buf := kvstate.BufferStream(s.Type())
		remind := kvstate.ReminderStream(s.Type())
		switch role {
		case Publisher:
			p.Pub.Allow.Add(s.AllData())
			p.Sub.Allow.Add(publisherInbox)
		case Region:
			p.Pub.Allow.Add(
				s.Region("*"),      // coordinator -> region commands
				s.Coordinator("*"), // a candidate probes the coordinator lease holder
				s.Events(),         // coordinator events
				s.BufferAll(),      // handoff buffer appends and end markers
				"$KV."+kvstate.BucketName(s.Type())+".>", // KV writes
				jsAPI+"INFO", // account info: creating a KV bucket asks for it
				jsAPI+"STREAM.CREATE."+kv,
				jsAPI+"STREAM.CREATE."+buf,
				jsAPI+"STREAM.INFO."+buf,
				jsAPI+"STREAM.MSG.GET."+buf,
				jsAPI+"STREAM.PURGE."+buf,
				// Replays: a pull consumer read by fetches, its info
				// logged while a replay waits.
				jsAPI+"CONSUMER.CREATE."+buf,
				jsAPI+"CONSUMER.CREATE."+buf+".>",
				jsAPI+"CONSUMER.MSG.NEXT."+buf+".*",
				jsAPI+"CONSUMER.INFO."+buf+".*",
				jsAPI+"CONSUMER.DELETE."+buf+".*",
				// Answers to requests replayed from the buffer, and to
				// requests of durable delivery: their reply subject comes
				// from a header, so the response permission below does not
				// cover them: a publisher's inbox, or a region's or an
				// admin's (InboxPrefix).
				publisherInbox,
				privilegedInboxes+".>",
				// Entities send to entities (Env.Client).
				s.AllData(),
				// Durable delivery: the message stream (created, read by
				// each shard's owner through a pull
				// consumer it replaces, acknowledged), and the reminders
				// (stored, cancelled by a purge of their subject).
				jsAPI+"STREAM.CREATE."+remind,
				jsAPI+"STREAM.INFO."+remind,
				jsAPI+"STREAM.PURGE."+remind,
				s.AllReminders(),
			)
			// The message streams: the single one, or those its
			// messages are split over (any of the names a type may have,
			// kvstate.AllMessageStreams; a split adds subjects to them).
			for _, msgs := range kvstate.AllMessageStreams(s.Type()) {
				p.Pub.Allow.Add(
					jsAPI+"STREAM.CREATE."+msgs,
					jsAPI+"STREAM.INFO."+msgs,
					jsAPI+"STREAM.MSG.GET."+msgs, // a handed-off shard's last message removed
					jsAPI+"CONSUMER.CREATE."+msgs+".>",
					jsAPI+"CONSUMER.DELETE."+msgs+".*",
					jsAPI+"CONSUMER.INFO."+msgs+".*",
					jsAPI+"CONSUMER.MSG.NEXT."+msgs+".*",
					"$JS.ACK."+msgs+".>",
				)
				if msgs != kvstate.MessageStream(s.Type()) {
					p.Pub.Allow.Add(jsAPI + "STREAM.UPDATE." + msgs)
				}
			}
			p.Pub.Allow.Add(kvRead(kv)...)
			// What shardd's web UI shows (package web): the coordinator's
			// status, the regions' queries, the events. Nothing the role
			// could not read from KV or publish itself already.
			p.Pub.Allow.Add(s.Admin(protocol.AdminStatus), s.Query("*"))
			p.Sub.Allow.Add(s.Events())
			p.Sub.Allow.Add(s.AllData(), s.Region("*"), s.Coordinator("*"), s.Query("*"), s.AdminAll(), inbox)
			// Answers to every request delivered to the region: entity
			// answers, command replies, queries, admin API answers.
			p.Resp = &jwt.ResponsePermission{MaxMsgs: 1}
		case Admin:
			p.Pub.Allow.Add(s.AdminAll(), s.Query("*"), s.AllData(), jsAPI+"STREAM.INFO."+buf)
			for _, msgs := range kvstate.AllMessageStreams(s.Type()) {
				p.Pub.Allow.Add(jsAPI + "STREAM.INFO." + msgs)
			}
			p.Pub.Allow.Add(kvRead(kv)...)
			p.Sub.Allow.Add(s.Events(), inbox)
		default:
			return p, fmt.Errorf("%w: %q", ErrUnknownRole, role)
		}
	}
	slices.Sort(p.Pub.Allow)
	p.Pub.Allow = slices.Compact(p.Pub.Allow)
	slices.Sort(p.Sub.Allow)
	p.Sub.Allow = slices.Compact(p.Sub.Allow)
	return p, nil
}

// kvRead is the JetStream API a reader of the KV stream kv uses (kvstate):
// stream info, reads from the stream leader, and the ordered consumers of
// watches (their flow control replies included, in the two formats of
// $JS.FC subjects).
func kvRead(kv string) []string {
	return []string{
		jsAPI + "STREAM.INFO." + kv,
		jsAPI + "STREAM.MSG.GET." + kv,
		jsAPI + "CONSUMER.CREATE." + kv,
		jsAPI + "CONSUMER.CREATE." + kv + ".>",
		jsAPI + "CONSUMER.DELETE." + kv + ".*",
		"$JS.FC." + kv + ".>",
		"$JS.FC.*.*." + kv + ".>",
	}
}

// inboxOf returns the inbox prefix that permissions p restrict their user
// to (InboxPrefix), or "" when p allows the default inboxes.
func inboxOf(p jwt.Permissions) string {
	for _, s := range p.Sub.Allow {
		// "_INBOX_<name>.>" before the prefixes shared a token, then
		// "_INBOX_natshard.<name>.>".
		if pre, ok := strings.CutSuffix(s, ".>"); ok && strings.HasPrefix(pre, "_INBOX_") && pre != privilegedInboxes {
			return pre
		}
	}
	return ""
}
