package coordinator

import (
	"testing"

	"github.com/nats-io/nats-server/v2/server"
)

// TestByClientReasons: the reasons, as the server names them in its
// advisories, that mean the client's end is gone. A process killed while
// the server was sending it messages is found by the server's write
// ("Write Error": broken pipe or reset), by its read loop when it reads
// first ("Read Error"); one region kill of 25 in `shardctl bench
// --failover` was found by the 300 ms silence instead of the advisory
// before "Write Error" counted. TestDisconnectAdvisoryReasons reads the
// first and second from a real server; which of a read and a write
// meets a reset first is a race, so the third is checked here only.
func TestByClientReasons(t *testing.T) {
	for reason, want := range map[server.ClosedState]bool{
		server.ClientClosed:              true,
		server.ReadError:                 true,
		server.WriteError:                true,
		server.StaleConnection:           false, // the client may be alive behind a partition
		server.SlowConsumerPendingBytes:  false,
		server.SlowConsumerWriteDeadline: false,
		server.ServerShutdown:            false,
		server.AuthenticationExpired:     false,
	} {
		if got := byClient(reason.String()); got != want {
			t.Errorf("byClient(%q) = %v, want %v", reason.String(), got, want)
		}
	}
}
