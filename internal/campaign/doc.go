// Package campaign is the pure half of natshard's randomized fault
// campaign (docs/FAULTS.md, "Randomized fault campaign" and "Guarantees":
// proven by search): the seeded fault schedule and the history checker.
// It does no I/O, reads no clock and imports only the standard library;
// integration.TestCampaign drives real processes with it.
//
// The schedule is a pure function of its seed and Config: Schedule(seed,
// cfg) returns the same faults, at the same offsets, on every machine, so
// a run is reproduced by its seed. Faults come from a menu (Kinds), one
// every 3-8 s, at most two in force at once, each healed after 1-10 s
// (a SIGSTOP after 1-12 s); a region or the NATS cluster bears one fault
// at a time.
//
// The checker shares nothing with natshard beyond the public contract:
// the subject shard.<type>.<shard>.<id> with shard = fnv1a32(id) % N
// (Shard, computed here), and the kv entity's append and get. Given what
// the load generator sent to each entity (with each send's outcome:
// acknowledged, sent, unknown, refused) and the history it read back after
// the run, Check counts per delivery mode, keyed (Nats-Msg-Id) and keyless
// apart: values lost, applied twice, applied out of order and applied
// though never sent, and attributes each to the faults in force when the
// value was sent.
package campaign
