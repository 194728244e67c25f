package kvstate

// This file fixes the API of kvstate. Implementation lives in store.go,
// lease.go, table.go, entity.go and watch.go.

import (
	"errors"
	"time"
)

// Errors returned by Store. NATS and JetStream errors are translated into
// these in one place (errors.go); the original error stays wrapped.
var (
	// ErrNotFound: the key does not exist (or was deleted, or expired).
	ErrNotFound = errors.New("kvstate: not found")
	// ErrConflict: a compare-and-set failed: the key exists when it was to be
	// created, or its revision is not the expected one. For a lease it means
	// the lease is held by someone else or was lost.
	ErrConflict = errors.New("kvstate: conflict")
	// ErrFenced: a fenced write was refused by the server because the
	// coordinator lease moved on: the writer is no longer the coordinator.
	ErrFenced = errors.New("kvstate: fenced: coordinator lease moved on")
	// ErrConfigMismatch: the process's type configuration disagrees with the
	// one stored in the bucket (for example the shard count).
	ErrConfigMismatch = errors.New("kvstate: configuration mismatch")
	// ErrUnavailable: NATS or JetStream did not answer (timeout, no
	// connection, no JetStream, no responders).
	ErrUnavailable = errors.New("kvstate: unavailable")
	// ErrMalformed: a stored value does not decode.
	ErrMalformed = errors.New("kvstate: malformed value")
)

// Options configure Open.
type Options struct {
	// Replicas of the bucket's stream; 0 means 1.
	Replicas int
	// Timeout bounds each operation whose context has no deadline; 0 means 5s.
	Timeout time.Duration
}

// Lease is a held key with a time to live, renewed by compare-and-set.
// Revision is the stream sequence of the last write of the key by the
// holder: the fencing token for writes fenced on this lease.
type Lease struct {
	Key      string
	Revision uint64
	TTL      time.Duration

	value []byte // what the holder wrote at Revision (see Store.ownLater)
}

// Keys of the bucket.
const (
	KeyConfig      = "config"
	KeyCoordinator = "coordinator"
	prefixRegions  = "regions."
	prefixShards   = "shards."
	prefixPins     = "pins."
	prefixEntities = "entities."
)

// BucketName is the KV bucket of type typ.
func BucketName(typ string) string { return "natshard_" + typ }
