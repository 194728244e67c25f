package kvstate

// This file fixes the API of kvstate. Implementation lives in store.go,
// lease.go, table.go, entity.go and watch.go.

import (
	"errors"
	"log/slog"
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
	// ErrNoSpace: JetStream refused a write for lack of space (a server's
	// store full, an account at its storage limit, a stream at its max
	// bytes), or a budget refused it to keep a stream's reserve for the
	// writes that must not fail (space.go). The error says which. It is
	// also ErrUnavailable: the same write may pass once space is freed.
	ErrNoSpace error = noSpaceError{}
)

// noSpaceError is ErrNoSpace's type: it is also ErrUnavailable.
type noSpaceError struct{}

func (noSpaceError) Error() string { return "kvstate: no space" }
func (noSpaceError) Unwrap() error { return ErrUnavailable }

// Options configure Open.
type Options struct {
	// Replicas of the bucket's stream; 0 means 1.
	Replicas int
	// Timeout bounds each operation whose context has no deadline; 0 means 5s.
	Timeout time.Duration
	// MaxBytes of the bucket's stream when it is created (a reservation in
	// the JetStream store, see space.go); 0 or less: no limit. An existing
	// bucket keeps its own. With a limit, entity state writes are refused
	// (ErrNoSpace) once the bucket reaches its reserve (reserveFor), which
	// is kept for leases, registrations and the shard table.
	MaxBytes int64
	// Logger, when set, gets a warning when the bucket has no byte limit,
	// and at most every 10 s while writes are refused for lack of space.
	Logger *slog.Logger
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
