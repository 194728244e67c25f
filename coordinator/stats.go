package coordinator

import (
	"sync/atomic"
	"time"

	"github.com/natshard/natshard/protocol"
)

// What a coordinator candidate tells metrics and traces (package natshard
// serves them): counters kept as it decides (Stats), and each move of a
// shard reported with its times once it ended (Config.OnMove). Neither
// changes a decision.

// Stats are counters of a coordinator candidate, safe to read at any time.
// Config.Stats (and CoreConfig.Stats, which the candidate passes on) keeps
// them up to date; they count from the candidate's start, across its
// terms of leadership, and only the leader's change.
type Stats struct {
	Leading        atomic.Bool   // the candidate holds the lease and leads
	Epoch          atomic.Uint64 // the epoch it leads; 0 when it does not
	Terms          atomic.Uint64 // terms of leadership begun (lease taken)
	RenewalsFailed atomic.Uint64 // lease renewals that failed (the term goes on until the lease may have expired)

	// Moves of live shards: started (HandOff sent to the owner), and how
	// they ended: completed (the source paused and was released, the
	// target went active), timed out (the source did not pause within
	// HandOffTimeout: dropped there and reallocated, Akka's forced
	// reallocation) or forced (the source was lost during the move: the
	// coordinator took the shard over). Started minus the others is in
	// flight, or was cut short by a change of leader.
	HandOffsStarted, HandOffsCompleted, HandOffsTimedOut, HandOffsForced atomic.Uint64
	// Rounds: rebalance rounds (periodic or asked for) that started
	// moves; RoundMoves: the moves they started.
	Rounds, RoundMoves atomic.Uint64
	// Splits: splits of the type this candidate recorded (Reshard).
	Splits atomic.Uint64

	// ParkedMessages: messages of parked shards the leader diverted to the
	// buffer; ParkRefused: of those, the ones the buffer refused (full, or
	// an error): lost, answered with an error.
	ParkedMessages, ParkRefused atomic.Uint64

	// shards counts the leader's table by state (Shards).
	shards [len(tableStates)]atomic.Int64
}

// tableStates are the states of a shard table row that Stats counts.
var tableStates = [...]protocol.ShardState{
	protocol.StateActive, protocol.StateParked, protocol.StateHandoff, protocol.StateBinding, protocol.StateUnowned,
}

// Shards returns how many shards of the leader's table are in each state
// (active, parked, handoff, binding, unowned); all zero while the
// candidate does not lead.
func (s *Stats) Shards() map[protocol.ShardState]int64 {
	out := make(map[protocol.ShardState]int64, len(tableStates))
	for i, st := range tableStates {
		out[st] = s.shards[i].Load()
	}
	return out
}

func stateIndex(st protocol.ShardState) int {
	for i, s := range tableStates {
		if s == st {
			return i
		}
	}
	return len(tableStates) - 1 // unknown states count as unowned
}

// Move is a shard's move as the leader saw it through its table writes,
// reported to Config.OnMove when the move ended. A move either starts at
// a live owner (From is the source: HandOff, then Bind) or at a parked
// shard (From is empty: the coordinator held it; Bind only).
type Move struct {
	Shard   int
	Handoff uint64 // the move's handoff id (its end marker)
	From    string // the source region; "" for a parked shard
	To      string // the target region the shard was last bound to; "" if none
	// Began: the move started (handoff, or parked, written). Paused: the
	// source reported its entities stopped and the shard was bound to the
	// target (binding written); zero for a parked shard, and when the
	// source did not pause (timed out, or lost). Bound: the last Bind of
	// the move (binding written; a move whose target died binds again);
	// zero if it never bound. Ended: active, or parked again, written.
	Began, Paused, Bound, Ended time.Time
	// Done: the shard went active on To. Otherwise the move was abandoned
	// (the shard was parked again: its source or target was lost, or no
	// region could take it) and a new move of the parked shard follows.
	Done bool
}

// moveTracker follows the table writes of one term of leadership: the
// rows by state (Stats) and the moves in flight (OnMove). Only the
// leader's goroutine uses it.
type moveTracker struct {
	stats  *Stats
	onMove func(Move)
	rows   []protocol.ShardRecord
	moves  map[int]*Move
}

// newMoveTracker starts tracking the table of shards rows read at
// takeover (rows may be missing). Moves under way then are not timed
// (their beginning is unknown).
func newMoveTracker(stats *Stats, onMove func(Move), shards int, table []protocol.ShardRecord) *moveTracker {
	t := &moveTracker{stats: stats, onMove: onMove, rows: make([]protocol.ShardRecord, shards), moves: map[int]*Move{}}
	for i := range t.rows {
		t.rows[i] = protocol.ShardRecord{Shard: i, State: protocol.StateUnowned}
	}
	for _, r := range table {
		if r.Shard >= 0 && r.Shard < shards {
			t.rows[r.Shard] = r
		}
	}
	for i := range stats.shards {
		stats.shards[i].Store(0)
	}
	for _, r := range t.rows {
		stats.shards[stateIndex(r.State)].Add(1)
	}
	return t
}

// grow extends the tracked table to n shards (a split): the new rows are
// counted unowned until their writes come.
func (t *moveTracker) grow(n int) {
	for sh := len(t.rows); sh < n; sh++ {
		t.rows = append(t.rows, protocol.ShardRecord{Shard: sh, State: protocol.StateUnowned})
		t.stats.shards[stateIndex(protocol.StateUnowned)].Add(1)
	}
}

// written notes a table write accepted at now.
func (t *moveTracker) written(rec protocol.ShardRecord, now time.Time) {
	if rec.Shard < 0 || rec.Shard >= len(t.rows) {
		return
	}
	prev := t.rows[rec.Shard]
	t.rows[rec.Shard] = rec
	t.stats.shards[stateIndex(prev.State)].Add(-1)
	t.stats.shards[stateIndex(rec.State)].Add(1)
	m := t.moves[rec.Shard]
	switch rec.State {
	case protocol.StateHandoff:
		if m == nil || m.Handoff != rec.Handoff {
			t.moves[rec.Shard] = &Move{Shard: rec.Shard, Handoff: rec.Handoff, From: rec.Source, Began: now}
		}
	case protocol.StateParked:
		if m != nil {
			t.end(m, now, false)
		}
		t.moves[rec.Shard] = &Move{Shard: rec.Shard, Handoff: rec.Handoff, Began: now}
	case protocol.StateBinding:
		if m == nil || m.Handoff != rec.Handoff {
			return // under way at takeover
		}
		if prev.State == protocol.StateHandoff && rec.Source != "" {
			m.Paused = now
		}
		m.To, m.Bound = rec.Region, now
	case protocol.StateActive:
		if m != nil && m.Handoff == rec.Order {
			t.end(m, now, true)
		} else if m != nil {
			delete(t.moves, rec.Shard)
		}
	}
}

func (t *moveTracker) end(m *Move, now time.Time, done bool) {
	delete(t.moves, m.Shard)
	m.Ended, m.Done = now, done
	if t.onMove != nil {
		t.onMove(*m)
	}
}

// stop ends the term: the table is no longer this candidate's to count.
func (t *moveTracker) stop() {
	for i := range t.stats.shards {
		t.stats.shards[i].Store(0)
	}
}

// round counts a rebalance round that starts moves.
func (s *Stats) round(moves int) {
	if moves > 0 {
		s.Rounds.Add(1)
		s.RoundMoves.Add(uint64(moves))
	}
}
