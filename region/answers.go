package region

import (
	"fmt"

	"github.com/natshard/natshard/region/internal/host"
)

// KeptAnswer is an entity's answer to a message with an idempotency key
// (Message.IdempotencyKey): what a message sent again with that key is
// answered with, instead of being handled again.
type KeptAnswer = host.KeptAnswer

// AnswerKeeper is an Entity that keeps the answers to the keyed messages
// it applied with its state (saved in the same compare-and-set), so that
// they outlive its activation: a move of its shard, a passivation, a
// crash. Before the region gives a message with an idempotency key to
// Handle, it looks for the key among the answers it kept itself during
// the entity's activation, then asks Answer: when either has it, the
// message is answered with it and not handled. The built-in kv kind is
// one; Answers is the window such an entity can keep.
type AnswerKeeper = host.AnswerKeeper

// Answers is a window of answers to keyed messages: the last MaxKeys
// keys, and their answers while they fit in MaxBytes with the keys (past
// it the oldest answers go and their keys stay, Dropped). The zero value keeps nothing; a region keeps one per
// active entity, and a persistent entity may keep one with its state
// (Encode, Decode). It is not safe for concurrent use.
type Answers = host.Answers

// The window of answers a persistent entity saves with its state (the kv
// kind, natshard.State): the keys of its last SavedAnswers keyed changes,
// and their answers while they fit in SavedAnswerBytes (encoded,
// they ride in a header of the state's KV message, beside a state of up
// to 1 MiB less 4 KiB). An answer larger than that is saved as
// AppliedAnswer's error.
const (
	SavedAnswers     = 32
	SavedAnswerBytes = 2 << 10
)

// SavedAnswer is the answer data (or the error errText, when not "") to
// the message with key as a persistent entity saves it: itself, or, when
// larger than SavedAnswerBytes, an error that says the message was
// applied already, so that it is still never applied twice.
func SavedAnswer(key string, data []byte, errText string) KeptAnswer {
	if len(key)+len(data)+len(errText) <= SavedAnswerBytes {
		return KeptAnswer{Key: key, Data: data, Error: errText}
	}
	return KeptAnswer{Key: key, Error: fmt.Sprintf("applied once already; its answer of %d bytes was larger than the %d bytes kept with the state", len(data)+len(errText), SavedAnswerBytes)}
}
