// Package ratelimit is an in-memory rate limiter, hosted as a natshard
// entity type: one token bucket per key (a user, an API key), so that every
// process of a service asks the one place that counts for that key.
//
// A limiter holds its bucket in memory only: when it is passivated (idle
// for a minute) or its shard moves to another process, it starts again
// full. That is the right trade for a limiter, and it makes the type cheap:
// nothing is written anywhere.
//
// Any message asks for one token; the answer is {"allowed":true,"tokens":4}
// (the tokens left).
package ratelimit

import (
	"context"
	"encoding/json"
	"time"

	"github.com/natshard/natshard"
)

// Type is the rate limiter entity type: each key may make rate requests a
// second, and bursts of burst. An idle limiter is forgotten after a
// minute (it would be full again by then).
func Type(rate float64, burst int) natshard.Type {
	return natshard.Type{
		Name: "ratelimit",
		Entity: func(context.Context, string) (natshard.Entity, error) {
			return &limiter{rate: rate, burst: float64(burst), tokens: float64(burst), last: time.Now()}, nil
		},
		IdleTimeout: time.Minute,
	}
}

type limiter struct {
	rate, burst float64
	tokens      float64
	last        time.Time
}

// Answer is a limiter's answer.
type Answer struct {
	Allowed bool `json:"allowed"`
	Tokens  int  `json:"tokens"` // left after this request
}

// Handle takes a token if there is one. natshard calls it with one message
// at a time, so the bucket needs no lock.
func (l *limiter) Handle(context.Context, *natshard.Message) ([]byte, error) {
	now := time.Now()
	l.tokens = min(l.burst, l.tokens+now.Sub(l.last).Seconds()*l.rate)
	l.last = now
	allowed := l.tokens >= 1
	if allowed {
		l.tokens--
	}
	return json.Marshal(Answer{Allowed: allowed, Tokens: int(l.tokens)})
}

// Stop forgets the bucket.
func (l *limiter) Stop(context.Context) error { return nil }
