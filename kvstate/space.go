package kvstate

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Running out of space.
//
// A JetStream server refuses every write to its file store once the
// bytes its streams hold exceed max_file_store (error 10023, "insufficient
// resources", checked before any stream's own limits), an account over
// its storage limit gets 10002, and a stream with MaxBytes and
// DiscardNew refuses the messages that would take it past that limit
// (10077, "maximum bytes exceeded"). A stream's MaxBytes is also a
// reservation: the server refuses to create a stream whose MaxBytes does
// not fit in what max_file_store leaves after the reservations of the
// streams it has (10047 on a single server; on a cluster, where each
// replica reserves it on its own server, 10005 "no suitable peers for
// placement, insufficient storage"). So when every stream of a
// server has a MaxBytes, the store cannot fill up, and each stream is
// refused only its own excess.
//
// natshard gives its three streams (the type's KV bucket, its handoff
// buffer, its durable message stream) a MaxBytes. Within the bucket and
// the buffer, some writes must not be refused for space: the leases, the
// registrations and the shard table (without them the type stops
// serving), and the buffer's end markers (without one a handoff waits
// for ever). JetStream has no per-subject byte quota, and a replicated
// stream at its MaxBytes refuses even a write that replaces a key's only
// message with one of the same size (a single server lets it through).
// So natshard keeps the last bytes of those two streams for those
// writes: a budget refuses, in the client, entity state writes and
// buffered messages that would eat into the reserve (ErrNoSpace), and
// lets everything else through.

// Budget settings.
const (
	// budgetRefresh: how old the known size of a stream may be before a
	// write that is checked against its budget reads it again.
	budgetRefresh = 250 * time.Millisecond
	// budgetRefreshNear: the same near the limit (refreshNeeded).
	budgetRefreshNear = 10 * time.Millisecond
	// minReserve and maxReserve clamp a stream's reserve (reserveFor).
	minReserve = 64 << 10
	maxReserve = 64 << 20
	// spaceLogEvery: a stream's refusals are logged at most this often.
	spaceLogEvery = 10 * time.Second
)

// reserveFor is how many of a stream's maxBytes are kept for the writes
// that must not be refused: a sixteenth, at least 64 KiB and at most 64
// MiB, and never more than half. For a bucket, 64 MiB hold the shard
// table of 65 536 shards several times over; the default 1 GiB bucket
// keeps 64 MiB.
func reserveFor(maxBytes int64) int64 {
	if maxBytes <= 0 {
		return 0
	}
	return min(max(maxBytes/16, minReserve), maxReserve, maxBytes/2)
}

// overBudget says whether a write of size bytes to a stream that holds
// used bytes of maxBytes would eat into its reserve. No limit (maxBytes
// <= 0) is never over.
func overBudget(used, size, maxBytes, reserve int64) bool {
	return maxBytes > 0 && used+size > maxBytes-reserve
}

// refreshNeeded says whether the known size used, read age ago, must be
// read again before a write of size bytes is judged, and whether the
// write should wait for it rather than be judged on the old figure while
// it is read in the background. Far from the limit the size is read
// every budgetRefresh in the background. Near it (within four reserves:
// the last 256 MiB of a large stream) a write waits for a size at most
// budgetRefreshNear old: other processes write too, and what they wrote
// since the last read must not be more than the reserve.
func refreshNeeded(used, size, maxBytes, reserve int64, age time.Duration) (refresh, wait bool) {
	if maxBytes <= 0 {
		return false, false
	}
	if used+size > maxBytes-4*reserve {
		return age >= budgetRefreshNear, age >= budgetRefreshNear
	}
	return age >= budgetRefresh, false
}

// budget guards a stream's reserve (see the comment at the top). Safe
// for concurrent use; a nil budget admits everything.
//
// It counts a write from the moment it is admitted, not from its end: a
// process may have many writes in flight (the buffer's asynchronous
// appends, entities' concurrent saves), and each is judged against the
// others. And a read of the stream's size keeps the writes that ended
// while it was in flight: the server's figure may be older than they are.
// Both err on the side of the reserve; the next read corrects the excess.
type budget struct {
	stream   string
	maxBytes int64
	reserve  int64
	what     string // what is refused, for the error: "entity state", "buffered messages"
	// size reads the stream's bytes (its state, from the server).
	size func(ctx context.Context) (int64, error)

	mu         sync.Mutex
	known      int64     // bytes, as read at readAt plus the writes that ended since the read was sent
	inflight   int64     // bytes of admitted writes not ended yet
	ended      int64     // bytes of every write ended so far (a read adds those that ended while it was in flight)
	readAt     time.Time // zero: never read
	refreshing bool
}

// newBudget is the budget of stream, or nil when it has no MaxBytes.
func newBudget(stream string, maxBytes, used int64, what string, size func(context.Context) (int64, error)) *budget {
	if maxBytes <= 0 {
		return nil
	}
	return &budget{stream: stream, maxBytes: maxBytes, reserve: reserveFor(maxBytes), what: what, size: size,
		known: used, readAt: time.Now()}
}

// admit counts a write of size bytes, or returns ErrNoSpace when it
// would eat into the reserve. With wait it may read the stream's size
// first (near the limit, when the known size is old), within ctx;
// without, it never blocks and judges on the known size while a fresh
// one is read. A write admitted is ended with end once it is stored or
// failed. The caller logs a refusal (spaceLog).
func (b *budget) admit(ctx context.Context, size int64, wait bool) error {
	if b == nil {
		return nil
	}
	b.mu.Lock()
	refresh, sync := refreshNeeded(b.known+b.inflight, size, b.maxBytes, b.reserve, time.Since(b.readAt))
	if refresh && sync && wait {
		b.mu.Unlock()
		b.read(ctx)
		b.mu.Lock()
	} else if refresh && !b.refreshing {
		b.refreshing = true
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), defaultTimeout)
			defer cancel()
			b.read(ctx)
			b.mu.Lock()
			b.refreshing = false
			b.mu.Unlock()
		}()
	}
	used := b.known + b.inflight
	over := overBudget(used, size, b.maxBytes, b.reserve)
	if !over {
		b.inflight += size
	}
	b.mu.Unlock()
	if !over {
		return nil
	}
	err := fmt.Errorf("%w: stream %s holds %d of its %d bytes (max bytes; with this process's writes in flight); its last %d bytes are kept for leases, the shard table and end markers, so %s is refused until space is freed",
		ErrNoSpace, b.stream, used, b.maxBytes, b.reserve, b.what)
	return err
}

// read reads the stream's size; an error keeps the old figure.
func (b *budget) read(ctx context.Context) {
	b.mu.Lock()
	from := b.ended
	b.mu.Unlock()
	n, err := b.size(ctx)
	if err != nil {
		return
	}
	b.mu.Lock()
	b.known, b.readAt = n+b.ended-from, time.Now()
	b.mu.Unlock()
}

// end ends a write that admit counted, stored or not (a failed write's
// bytes stay counted until the next read).
func (b *budget) end(size int64) {
	if b == nil {
		return
	}
	b.mu.Lock()
	b.inflight -= size
	b.known += size
	b.ended += size
	b.mu.Unlock()
}

// add counts a write of size bytes that admit did not count (a write
// let through a full budget), until the next read.
func (b *budget) add(size int64) {
	if b == nil {
		return
	}
	b.mu.Lock()
	b.known += size
	b.ended += size
	b.mu.Unlock()
}

// streamBytes returns a function that reads the bytes stream holds.
func streamBytes(js jetstream.JetStream, stream string) func(context.Context) (int64, error) {
	return func(ctx context.Context) (int64, error) {
		st, err := js.Stream(ctx, stream)
		if err != nil {
			return 0, err
		}
		return int64(st.CachedInfo().State.Bytes), nil
	}
}

// msgSize approximates what a message takes in a file store: its subject,
// headers and data, and the store's own record (see nats-server's
// fileStoreMsgSize).
func msgSize(subject string, hdrLen, dataLen int) int64 {
	return int64(22 + len(subject) + hdrLen + dataLen + 8)
}

// noSpaceCause says why err is a refusal for lack of space, "" when it is
// not one.
func noSpaceCause(err error) string {
	switch apiCode(err) {
	case codeInsufficientResources:
		return "insufficient resources: a JetStream server's store is full (its max_file_store or its disk), or cannot place the stream"
	case codeStorageExceeded:
		return "insufficient storage: the JetStream store cannot reserve the stream's max bytes (max_file_store less the other streams' reservations)"
	case codeMemoryExceeded:
		return "insufficient memory: the JetStream memory store is full"
	case codeAccountExceeded:
		return "the account's JetStream limits are reached (its max_file_store)"
	case codeNoPeers:
		if d := apiDescription(err); strings.Contains(d, "insufficient") {
			return "no server of the cluster has room to reserve the stream's max bytes on each replica (max_file_store less the other streams' reservations)"
		}
	case codeStoreFailed:
		if d := apiDescription(err); strings.Contains(d, msgMaxBytes) {
			return "the stream is at its byte limit (max bytes)"
		}
	}
	return ""
}

// JetStream API error codes of refusals for lack of space (nats-server's
// jetstream_errors_generated.go).
const (
	codeInsufficientResources jetstream.ErrorCode = 10023
	codeStorageExceeded       jetstream.ErrorCode = 10047
	codeMemoryExceeded        jetstream.ErrorCode = 10028
	codeAccountExceeded       jetstream.ErrorCode = 10002
	codeNoPeers               jetstream.ErrorCode = 10005 // placement; "insufficient storage" among the reasons
)

// msgMaxBytes is the description of a store refusal at a stream's
// MaxBytes with DiscardNew (nats-server's ErrMaxBytes).
const msgMaxBytes = "maximum bytes exceeded"

// apiDescription is the description of the JetStream API error in err's
// chain, "" if none.
func apiDescription(err error) string {
	var a *jetstream.APIError
	if errors.As(err, &a) {
		return a.Description
	}
	return ""
}

// spaceLog logs a stream's refusals for lack of space at most every
// spaceLogEvery, with how many there were. Safe for concurrent use; a
// nil spaceLog or one without logger logs nothing.
type spaceLog struct {
	log      *slog.Logger
	stream   string
	maxBytes int64

	mu   sync.Mutex
	last time.Time
	n    int
}

func newSpaceLog(log *slog.Logger, stream string, maxBytes int64) *spaceLog {
	return &spaceLog{log: log, stream: stream, maxBytes: maxBytes}
}

// refused notes a refusal (err names its cause).
func (l *spaceLog) refused(err error) {
	if l == nil || l.log == nil {
		return
	}
	l.mu.Lock()
	l.n++
	if time.Since(l.last) < spaceLogEvery {
		l.mu.Unlock()
		return
	}
	n := l.n
	l.last, l.n = time.Now(), 0
	l.mu.Unlock()
	limit := "none"
	if l.maxBytes > 0 {
		limit = fmt.Sprint(l.maxBytes)
	}
	l.log.Warn("JetStream refused writes for lack of space; they are refused until space is freed (docs/OPERATIONS.md, Storage)",
		"stream", l.stream, "max_bytes", limit, "refused", n, "err", err)
}

// noteIfNoSpace logs err through l when it is a refusal for lack of
// space.
func (l *spaceLog) noteIfNoSpace(err error) {
	if err != nil && (errors.Is(err, ErrNoSpace) || noSpaceCause(err) != "") {
		l.refused(err)
	}
}
