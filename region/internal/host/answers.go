package host

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"strings"

	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// KeptAnswer is an entity's answer to a message with an idempotency key
// (Message.IdempotencyKey): what a message sent again with that key is
// answered with, instead of being handled again.
type KeptAnswer struct {
	Key   string `json:"key"`
	Data  []byte `json:"data,omitempty"`
	Error string `json:"error,omitempty"` // the answer's Natshard-Error; "" for a success
	Code  string `json:"code,omitempty"`  // the error's code (Natshard-Error-Code), if it has one
	// Dropped: the message with Key was applied, and its answer was
	// dropped from a window too small for it (Answers.MaxBytes); it is
	// answered with ErrAnswerDropped, and not applied again.
	Dropped bool `json:"dropped,omitempty"`
}

// ErrAnswerDropped answers a message sent again with a key whose message
// was applied, once, and whose answer its window no longer holds.
var ErrAnswerDropped = errors.New("applied once already; its answer is no longer kept (a window of answers keeps the keys of the last changes, and their answers while they fit)")

// err is the error the answer is sent with (nil for a success).
func (a KeptAnswer) err() error {
	if a.Dropped {
		return ErrAnswerDropped
	}
	if a.Error == "" {
		return nil
	}
	if a.Code != "" {
		return &protocol.CodedError{Code: a.Code, Text: a.Error}
	}
	return errors.New(a.Error)
}

// Err is the error the answer is sent with (nil for a success).
func (a KeptAnswer) Err() error { return a.err() }

// droppedSize is what a dropped answer's marker counts against MaxBytes
// besides its key: about its encoding's `,"dropped":true`.
const droppedSize = 16

func (a KeptAnswer) size() int {
	if a.Dropped {
		return len(a.Key) + droppedSize
	}
	return len(a.Key) + len(a.Data) + len(a.Error) + len(a.Code)
}

// AnswerKeeper is an Entity that keeps the answers to the keyed messages
// it applied with its state (saved in the same compare-and-set), so that
// they outlive its activation: a move of its shard, a passivation, a
// crash. Before the region gives a message with an idempotency key to
// Handle, it looks for the key among the answers it kept itself during
// the entity's activation, then asks Answer: when either has it, the
// message is answered with it and not handled. The built-in kv kind is
// one; Answers is the window such an entity can keep.
type AnswerKeeper interface {
	Entity
	// Answer returns the answer the entity gave to the message with key,
	// false when it keeps none (it never applied it, or applied it before
	// the window it keeps). It is called from the entity's turn, as
	// Handle is.
	Answer(key string) (KeptAnswer, bool)
}

// Answers is a window of answers to keyed messages: the last MaxKeys
// keys, and their answers while they fit in MaxBytes with the keys. Past
// MaxBytes the answers are dropped, oldest first, and their keys kept
// (Dropped), so that a message sent again with one of the last MaxKeys
// keys is never applied again however large the answers; only when the
// keys alone take more than MaxBytes are the oldest keys dropped too
// (the last one always stays). The zero value keeps nothing; a region keeps one per
// active entity (entityAnswers), and a persistent entity may keep one
// with its state (Encode, Decode). It is not safe for concurrent
// use.
type Answers struct {
	MaxKeys, MaxBytes int
	list              []KeptAnswer // list[first:] are kept, oldest first
	first             int          // the answers before it were dropped (and cleared)
	bytes             int          // the kept answers' sizes, summed
}

// Get returns the answer kept for key, the latest if there are several.
func (a *Answers) Get(key string) (KeptAnswer, bool) {
	for i := len(a.list) - 1; i >= a.first; i-- {
		if a.list[i].Key == key {
			return a.list[i], true
		}
	}
	return KeptAnswer{}, false
}

// Add keeps ans, dropping what is beyond the window: the oldest keys
// past MaxKeys; then, past MaxBytes, answers (their keys stay); then,
// were the keys alone too many bytes, the oldest keys. The dropped
// entries leave the array once they are as many as MaxKeys (one copy of
// the kept ones then): a copy at every Add would move the whole window
// for each keyed message.
func (a *Answers) Add(ans KeptAnswer) {
	if a.MaxKeys <= 0 {
		return
	}
	a.list = append(a.list, ans)
	a.bytes += ans.size()
	for len(a.list)-a.first > a.MaxKeys {
		a.dropFirst()
	}
	// Past MaxBytes the answers go, oldest first (the last one too; one
	// smaller than its marker stays); their keys stay: a key forgotten is
	// a message applied twice.
	over := func() bool { return a.MaxBytes > 0 && a.bytes > a.MaxBytes }
	for i := a.first; over() && i < len(a.list); i++ {
		if m := (KeptAnswer{Key: a.list[i].Key, Dropped: true}); a.list[i].size() > m.size() {
			a.bytes += m.size() - a.list[i].size()
			a.list[i] = m
		}
	}
	for len(a.list)-a.first > 1 && over() { // the keys alone are too long
		a.dropFirst()
	}
	if a.first >= a.MaxKeys {
		n := copy(a.list, a.list[a.first:])
		clear(a.list[n:])
		a.list, a.first = a.list[:n], 0
	}
}

// dropFirst forgets the oldest entry kept.
func (a *Answers) dropFirst() {
	a.bytes -= a.list[a.first].size()
	a.list[a.first] = KeptAnswer{}
	a.first++
}

// Clone returns a copy of a that Add does not share.
func (a *Answers) Clone() Answers {
	c := *a
	c.list, c.first = slices.Clone(a.list[a.first:]), 0
	return c
}

// Len is how many answers are kept.
func (a *Answers) Len() int { return len(a.list) - a.first }

// Encode is the answers kept, as stored beside an entity's state in the
// protocol.HeaderAnswers header: a JSON array of {"key","data","error"}
// (data in base64), "" when none is kept.
func (a *Answers) Encode() string {
	if a.Len() == 0 {
		return ""
	}
	b, err := json.Marshal(a.list[a.first:])
	if err != nil {
		return "" // cannot happen: strings and bytes only
	}
	return string(b)
}

// Decode replaces the answers kept by those of s (Encode's), then
// applies the window. An empty s keeps none.
func (a *Answers) Decode(s string) error {
	clear(a.list)
	a.list, a.first, a.bytes = a.list[:0], 0, 0
	if s == "" {
		return nil
	}
	var list []KeptAnswer
	if err := json.Unmarshal([]byte(s), &list); err != nil {
		return fmt.Errorf("%w: %s: %v", protocol.ErrMalformed, protocol.HeaderAnswers, err)
	}
	for _, ans := range list {
		a.Add(ans)
	}
	return nil
}

// The window a region keeps for each active entity, whatever the entity
// keeps itself: the keys of the last 64 keyed messages, and their
// answers while they fit in 1 MiB.
const (
	answersKept      = 64
	answersKeptBytes = 1 << 20
)

// errNoAnswer answers a request for the answer of a key
// (protocol.HeaderAnswerOf) that its entity does not keep.
var errNoAnswer = errors.New("no answer kept for this key: its message was applied before the entity's window of answers, or failed before its entity handled it")

// recall looks for the answer to key among those kept for the entity of
// cell c (its activation's) and those the entity keeps with its state.
// An entity's Answer that panicked is recovered (logged): ok is false
// and panicked true.
func (h *Host) recall(se *shardEntities, c *cell, ent Entity, key string) (ans KeptAnswer, ok, panicked bool) {
	se.mu.Lock()
	kept := se.answers[c]
	se.mu.Unlock()
	if kept != nil {
		if ans, ok := kept.Get(key); ok {
			return ans, true, false
		}
	}
	k, keeps := ent.(AnswerKeeper)
	if !keeps {
		return KeptAnswer{}, false, false
	}
	defer func() {
		if r := recover(); r != nil {
			h.log.Error("region: entity's Answer panicked",
				"shard", se.n, "key", key, "panic", fmt.Sprint(r), "stack", string(debug.Stack()))
			ans, ok, panicked = KeptAnswer{}, false, true
		}
	}()
	ans, ok = k.Answer(key)
	return ans, ok, false
}

// keep records the entity's answer to the message with key, for the
// rest of the cell's life.
func (h *Host) keep(se *shardEntities, c *cell, key string, data []byte, err error) {
	ans := KeptAnswer{Key: key, Data: bytes.Clone(data)}
	if err != nil {
		ans.Error, ans.Code = err.Error(), protocol.ErrorCode(err)
	}
	se.mu.Lock()
	kept := se.answers[c]
	if kept == nil {
		if se.answers == nil {
			se.answers = make(map[*cell]*Answers)
		}
		kept = &Answers{MaxKeys: answersKept, MaxBytes: answersKeptBytes}
		se.answers[c] = kept
	}
	kept.Add(ans)
	se.mu.Unlock()
}

// answerKey reads the key of a message with headers h: the key it asks
// the answer of (ask), or else its idempotency key; "" when it has
// neither.
func answerKey(h map[string][]string) (key string, ask bool) {
	id, hasID := h[protocol.HeaderMsgID]
	if !hasID || len(h) > 1 {
		// (A message whose only header is its Nats-Msg-Id, as the
		// Client's publishes, asks for no answer: one lookup.)
		if v := h[protocol.HeaderAnswerOf]; len(v) > 0 && v[0] != "" {
			return v[0], true
		}
	}
	if k := h[protocol.HeaderKey]; len(k) > 0 && k[0] != "" {
		return k[0], false // a copy forwarded after a split carries its original's key
	}
	if len(id) == 0 || id[0] == "" || strings.HasPrefix(id[0], protocol.UniqueReplyMark) {
		return "", false
	}
	return protocol.IdempotencyKey(h), false
}

// transient: an entity's error that may pass if the message is sent
// again (JetStream did not answer, the shard's context ended): not kept
// as the message's answer, so that a message sent again with its key is
// handled again.
func transient(err error) bool {
	return err != nil && (errors.Is(err, kvstate.ErrUnavailable) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded))
}
