// Package drain ends a subscription without losing what it has received.
//
// nats.go discards the messages a subscription has received but not yet
// delivered when it is unsubscribed. A handoff source and the parking
// coordinator must still append those to the buffer before the end marker,
// so they drain the subscription and wait until it is closed.
package drain
