// Package entities holds the built-in entity kinds of shardd.
//
// # kv
//
// KV is a persistent JSON document per entity: a JSON object whose state is
// stored through a StateStore (in shardd, the type's kvstate bucket), so it
// survives passivation, handoff and restarts. Requests are JSON objects:
//
//	{"op":"get"}                            the whole document
//	{"op":"get","key":K}                    the value at K (null when absent)
//	{"op":"set","key":K,"value":V}          sets K to V
//	{"op":"incr","key":K,"by":N}            adds the integer N (default 1) to the
//	                                        integer at K (absent counts as 0)
//	{"op":"append","key":K,"value":V}       appends V to the array at K (created
//	                                        when absent); a string V is
//	                                        concatenated to a string at K
//	{"op":"delete","key":K}                 removes K
//
// The answer is {"ok":true,"value":...} with the value at the key after the
// operation (null after a delete, the whole document for a get without
// key), or {"ok":false,"error":"..."} together with a non-nil error, so that
// a region also sets the Natshard-Error header. Plain publishes are applied
// the same way; their answer is dropped.
//
// Numbers are kept as written (json.Number): integers of any size survive,
// and incr works on integers of any size. Every change is saved with a
// compare-and-set on the revision the entity holds BEFORE it is answered, so
// an acknowledged write is never lost; the in-memory document changes only
// after the save succeeded. When the save conflicts (someone else wrote the
// state, for example a previous owner during a forced reallocation), the
// entity reloads the state and applies the operation once more, unless
// the state read back is exactly what its save wrote: a save answered with
// a conflict and stored all the same (seen while the bucket's leader
// changed after a partition) is not applied twice. A document
// is limited to MaxDocumentSize bytes of JSON; deleting its last key leaves an
// empty document stored, never a deleted entry. Stop does nothing: the state
// is already saved.
//
// A request or publish with an idempotency key (a Nats-Msg-Id of its
// sender's, natshard.MsgID) is applied once however often it is sent: the
// entity saves the answers to its last KeptAnswers keyed changes
// (KeptAnswerBytes of them at most) with its document, in the same
// compare-and-set, and answers a message sent again with one of those
// keys as the first time, without applying it, in whichever process holds
// it after a move or a crash (region.AnswerKeeper; docs/PROTOCOL.md,
// "Idempotency keys").
//
// A save that JetStream did not answer (kvstate.ErrUnavailable, as while
// the bucket elects a leader for a few seconds after a NATS server's loss;
// not ErrNoSpace, which is answered at once) is tried again, in core
// delivery, for up to SaveRetryFor: the message exists
// nowhere else. The entity reads its state back before each new attempt,
// so that a save that was stored although its answer was lost is not
// applied twice. In durable delivery the region gives the message again
// instead (region.ErrUnavailable). A load of the state that JetStream did
// not answer (at activation, or to reload it after a conflict) is tried
// again for as long, in either delivery: the message waits for the
// election instead of failing.
//
// # echo
//
// Echo answers every request with its payload, unchanged. It has no state
// and every echo entity shares one value, so it measures the cost of
// routing alone.
package entities
