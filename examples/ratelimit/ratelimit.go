// Package ratelimit is an in-memory rate limiter, hosted as a typed
// natshard entity type: one token bucket per key (a user, an API key), so
// that every process of a service asks the one place that counts for that
// key.
//
// A limiter holds its bucket in memory only: when it is passivated (idle
// for a minute) or its shard moves to another process, it starts again
// full. That is the right trade for a limiter, and it makes the type cheap:
// nothing is written anywhere.
//
// Any message asks for one token (Key's Request is empty, and so may the
// body of a raw request be); the answer is
// {"allowed":true,"tokens":4} (the tokens left).
package ratelimit

import (
	"context"
	"time"

	"github.com/natshard/natshard"
)

// Request asks for a token.
type Request struct{}

// Answer is a limiter's answer.
type Answer struct {
	Allowed bool `json:"allowed"`
	Tokens  int  `json:"tokens"` // left after this request
}

// Key is the rate limiter type's.
var Key = natshard.NewKey[Request, Answer]("ratelimit")

// Type is the rate limiter entity type: each key may make rate requests a
// second, and bursts of burst. An idle limiter is forgotten after a
// minute (it would be full again by then).
func Type(rate float64, burst int) natshard.Type {
	t := natshard.TypeOf(Key, func(context.Context, string) (natshard.Handler[Request, Answer], error) {
		return &limiter{rate: rate, burst: float64(burst), tokens: float64(burst), last: time.Now()}, nil
	})
	t.IdleTimeout = time.Minute
	return t
}

type limiter struct {
	rate, burst float64
	tokens      float64
	last        time.Time
}

// Handle takes a token if there is one. natshard calls it with one request
// at a time, so the bucket needs no lock.
func (l *limiter) Handle(context.Context, Request) (Answer, error) {
	now := time.Now()
	l.tokens = min(l.burst, l.tokens+now.Sub(l.last).Seconds()*l.rate)
	l.last = now
	allowed := l.tokens >= 1
	if allowed {
		l.tokens--
	}
	return Answer{Allowed: allowed, Tokens: int(l.tokens)}, nil
}
