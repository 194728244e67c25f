package coordinator

import (
	"encoding/json"
	"fmt"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

// Disconnects reports the client connections that the NATS servers close,
// as the servers learn it: at once when a process dies (its socket
// closes), well before a probe would find it (Config.Disconnects).
type Disconnects interface {
	// Subscribe calls closed, from a goroutine of its own, with every
	// client connection that closes, until unsubscribe is called. closed
	// must not block.
	Subscribe(closed func(Disconnect)) (unsubscribe func(), err error)
}

// Disconnect is a client connection that a NATS server closed.
type Disconnect struct {
	Conn protocol.ConnID
	// ByClient: the client's end closed it: the server read the end of
	// its socket ("Client Closed": the process closed the connection, or
	// died with nothing unread), or found it reset when reading ("Read
	// Error": the process died with data it had not read, as a process
	// killed under load usually has) or when writing to it ("Write
	// Error": the server was sending it messages when the reset came).
	// No process is reconnecting behind it. Otherwise the server closed it
	// (a stale connection, a slow consumer, a server shutting down...)
	// and the client may be reconnecting.
	ByClient bool
}

// Reasons of a DisconnectEventMsg (nats-server's ClosedState strings) for
// a connection that its client's end closed: the end of its socket (EOF),
// or any other error reading from it or writing to it, a reset above all.
const (
	reasonClientClosed = "Client Closed"
	reasonReadError    = "Read Error"
	reasonWriteError   = "Write Error"
)

// byClient reports whether a DisconnectEventMsg's reason says the
// client's end closed the connection (Disconnect.ByClient).
func byClient(reason string) bool {
	return reason == reasonClientClosed || reason == reasonReadError || reason == reasonWriteError
}

// DisconnectSubject is where NATS servers publish, on their system
// account, that a client connection of any account closed (the server's
// DisconnectEventMsg, sent as soon as the connection is closed).
const DisconnectSubject = "$SYS.ACCOUNT.*.DISCONNECT"

// DisconnectAdvisories returns the Disconnects that sys reads from the
// servers' advisories on DisconnectSubject. sys is a connection to the
// system account of the servers natshard uses (or to an account that
// imports those subjects), separate from the coordinator's own.
//
// With an embedded server, configure a system account user (or let the
// server's own $SYS account have one) and connect with it in process; for
// an external server the operator provides the system account's
// credentials. Permissions: subscribe to DisconnectSubject.
func DisconnectAdvisories(sys *nats.Conn) Disconnects { return advisories{sys} }

type advisories struct{ nc *nats.Conn }

// disconnectEvent is what the coordinator reads of a server's
// DisconnectEventMsg (nats-server, server/events.go).
type disconnectEvent struct {
	Server struct {
		ID string `json:"id"`
	} `json:"server"`
	Client struct {
		ID uint64 `json:"id"`
	} `json:"client"`
	Reason string `json:"reason"`
}

func (a advisories) Subscribe(closed func(Disconnect)) (func(), error) {
	sub, err := a.nc.Subscribe(DisconnectSubject, func(m *nats.Msg) {
		var ev disconnectEvent
		if json.Unmarshal(m.Data, &ev) == nil {
			if c := (protocol.ConnID{Server: ev.Server.ID, Client: ev.Client.ID}); !c.IsZero() {
				closed(Disconnect{Conn: c, ByClient: byClient(ev.Reason)})
			}
		}
	})
	if err != nil {
		return nil, fmt.Errorf("coordinator: subscribe to %s: %w", DisconnectSubject, err)
	}
	if err := a.nc.Flush(); err != nil {
		_ = sub.Unsubscribe()
		return nil, fmt.Errorf("coordinator: subscribe to %s: %w", DisconnectSubject, err)
	}
	return func() { _ = sub.Unsubscribe() }, nil
}
