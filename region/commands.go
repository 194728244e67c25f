package region

import (
	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

// onCommand takes a coordinator command off its subscription and gives it
// to the driver, which answers it (driver.go, core.go). It runs on the
// subscription's goroutine, so commands reach the core in arrival order.
func (a *Agent) onCommand(m *nats.Msg) {
	var cmd protocol.Command
	err := protocol.Decode(m.Data, &cmd)
	if err == nil {
		err = cmd.Validate(a.layoutNow().Shards())
	}
	if err != nil {
		a.limit.log(a.log, "bad-command", "refused a malformed command", "err", err)
	}
	if now, gap, stalled := a.clock.check(); stalled {
		// The region did not run for a while, or its registration was
		// not renewed in time: the coordinator may have given its shards
		// away, and this command may be an old one. Suspend first
		// (stall.go): the core then refuses it (suspended) until the
		// shards are confirmed, and the coordinator sends it again.
		a.stalled(gap, now)
	}
	a.post(commandIn{CommandIn: CommandIn{ID: a.nextCmd.Add(1), Cmd: cmd, Err: err}, msg: m})
}
