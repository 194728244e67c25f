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
		err = cmd.Validate(a.cfg.Shards)
	}
	if err != nil {
		a.limit.log(a.log, "bad-command", "refused a malformed command", "err", err)
	}
	if a.clock.pastDeadline() {
		// The registration was not renewed in time (the region was
		// stopped, or could not reach JetStream): the coordinator may have
		// removed the region and given its shards away. Fence, as the
		// lease loop does when it gets to it; the core then refuses the
		// command (not registered).
		a.Fence("the registration deadline passed without a renewal")
	}
	a.post(commandIn{CommandIn: CommandIn{ID: a.nextCmd.Add(1), Cmd: cmd, Err: err}, msg: m})
}
