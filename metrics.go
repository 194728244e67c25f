package natshard

import (
	"context"
	"time"

	"github.com/natshard/natshard/coordinator"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/region"
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics. A node registers its collectors in Options.Metrics (never in
// the global registry): one collector that reads, at each scrape, the
// counters the regions and coordinator candidates keep anyway
// (region.Stats, region.EntityCounts, coordinator.Stats: atomics, and
// counts kept under locks the message path takes already), so that the
// message path pays nothing for metrics; and one histogram of handoff
// step durations, observed on the rare paths that end a step. Every metric
// has the labels type (the entity type) and region (the node's region id,
// a constant label: nodes of one process registered in one registry stay
// apart). docs/OPERATIONS.md lists them.

// DefaultStepBuckets are the buckets of natshard_handoff_duration_seconds:
// 1 ms to about 24 s.
var DefaultStepBuckets = prometheus.ExponentialBuckets(0.001, 2.5, 12)

// Steps of a handoff, the step label of natshard_handoff_duration_seconds.
const (
	// StepPause: the coordinator's HandOff until the source reported its
	// entities stopped (the leader's clock).
	StepPause = "pause"
	// StepBind: the coordinator's Bind until the shard was active on the
	// target (the target subscribed, the source was released and wrote
	// the end marker; for a parked shard, the coordinator did).
	StepBind = "bind"
	// StepMove: a move of a live shard, from the HandOff until active.
	StepMove = "move"
	// StepStop: at the source region, from HandOff until the shard's
	// entities stopped (their Stop hooks ran).
	StepStop = "stop"
	// StepReplay: at the target region, from Bind until the shard went
	// live (the buffer replayed up to the end marker, then what arrived
	// meanwhile).
	StepReplay = "replay"
)

type metricDesc struct {
	name, help string
	kind       prometheus.ValueType
	labels     []string // after type
}

// The metrics of one node; see docs/OPERATIONS.md.
var (
	mDelivered  = metricDesc{"natshard_messages_delivered_total", "Messages handed to entities: live, replayed from the buffer, or held during a replay or a suspension.", prometheus.CounterValue, nil}
	mRefused    = metricDesc{"natshard_messages_refused_total", "Messages no entity got, by reason: malformed (subject or shard), not_owned (the shard left without a handoff: not answered, its next holder answers its copy), buffer_full and buffer_error (a moving shard's buffer refused it: answered only while its source was the one holder), held_limit (too many held: refused while pausing, not answered during a replay or a suspension, or while pausing on a suspended or stalled region), stopping (the shard's entities were stopping: not answered where the shard left without a handoff after a stall). Requests among them were answered with an error, except where said.", prometheus.CounterValue, []string{"reason"}}
	mHandled    = metricDesc{"natshard_messages_handled_total", "Messages whose handling ended: Handle returned or panicked, or the entity could not be activated.", prometheus.CounterValue, nil}
	mFailed     = metricDesc{"natshard_messages_failed_total", "Of the messages handled, those that ended in an error: Handle's error, a panic, a failed activation.", prometheus.CounterValue, nil}
	mBuffered   = metricDesc{"natshard_messages_buffered_total", "Messages of shards paused for a handoff appended to the buffer by this region (refusals included).", prometheus.CounterValue, nil}
	mReplayed   = metricDesc{"natshard_messages_replayed_total", "Buffered messages replayed to entities.", prometheus.CounterValue, nil}
	mHeld       = metricDesc{"natshard_messages_held_total", "Messages that arrived while their shard's buffer was replayed, or while the region was suspended (reconnecting to NATS), held until then.", prometheus.CounterValue, nil}
	mOldSubject = metricDesc{"natshard_region_old_subject_messages_total", "Messages taken from a shard's ancestor subject (durable delivery: forwarded from a parent's subject to a child's, once per step): published with a shard count the type had before a split (PROTOCOL.md, Resharding). When it stays at 0, no publisher uses an old count any more.", prometheus.CounterValue, nil}
	mDupes      = metricDesc{"natshard_messages_duplicates_skipped_total", "Copies skipped: a message with their key (a Nats-Msg-Id, or a reply subject marked unique) was delivered since the shard was bound.", prometheus.CounterValue, nil}

	mActivations  = metricDesc{"natshard_entity_activations_total", "Entities activated (their factory returned one).", prometheus.CounterValue, nil}
	mPassivations = metricDesc{"natshard_entity_passivations_total", "Entities passivated: idle (stopped after the idle timeout), beyond the active-entity limit (chosen by its passivation policy), or at their own request (Env.Passivate).", prometheus.CounterValue, nil}
	mOverLimit    = metricDesc{"natshard_entity_passivations_over_limit_total", "Of the passivations, those chosen by the passivation policy (PassivationPolicy) while the region held more than its active-entity limit (MaxActive).", prometheus.CounterValue, nil}
	mRestarts     = metricDesc{"natshard_entity_restarts_total", "Remembered entities started again without a message, after their shard came to this region (Type.Remember).", prometheus.CounterValue, nil}
	mActive       = metricDesc{"natshard_entities_active", "Entities held by the region.", prometheus.GaugeValue, nil}

	mRegionShards     = metricDesc{"natshard_region_shards", "Shards held by the region, by mode: replaying (bound, replaying the buffer), live, paused (handing off), suspended (held while the region confirms them after a reconnect to NATS).", prometheus.GaugeValue, []string{"mode"}}
	mRegistered       = metricDesc{"natshard_region_registered", "1 while the region has a registration (its lease), 0 while it is fenced.", prometheus.GaugeValue, nil}
	mSuspended        = metricDesc{"natshard_region_suspensions_total", "Times the region's connection to NATS dropped while it was registered: its live shards held what arrived until it confirmed them (or fenced).", prometheus.CounterValue, nil}
	mStalls           = metricDesc{"natshard_region_stalls_total", "Times the region found it had not run for half the handoff timeout (its process stopped, a long GC pause, a VM stall) or had passed its registration deadline: its live shards held what arrived until it confirmed them (PROTOCOL.md, Zombie regions).", prometheus.CounterValue, nil}
	mSourceFenced     = metricDesc{"natshard_region_handoffs_fenced_total", "Shards the region dropped as it paused them: the coordinator had fenced their handoff (it timed out while the region did not run).", prometheus.CounterValue, nil}
	mFenced           = metricDesc{"natshard_region_fenced_total", "Times the region fenced itself: stopped serving every shard (registration lost or removed, renewals failing past their deadline, shards not confirmed in time after a reconnect).", prometheus.CounterValue, nil}
	mRegionRenewFails = metricDesc{"natshard_region_lease_renewals_failed_total", "Renewals of the region's registration that failed.", prometheus.CounterValue, nil}
	mCommandsRefused  = metricDesc{"natshard_region_commands_refused_total", "Coordinator commands the region refused (stale epoch, another incarnation, malformed, or the region closing, not registered or suspended).", prometheus.CounterValue, nil}

	mLeader          = metricDesc{"natshard_coordinator_leader", "1 while this node's candidate holds the coordinator lease and leads.", prometheus.GaugeValue, nil}
	mEpoch           = metricDesc{"natshard_coordinator_epoch", "The epoch this node's coordinator leads (the lease's revision); 0 when it does not lead.", prometheus.GaugeValue, nil}
	mTerms           = metricDesc{"natshard_coordinator_terms_total", "Terms of leadership this node's candidate began.", prometheus.CounterValue, nil}
	mCoordRenewFails = metricDesc{"natshard_coordinator_lease_renewals_failed_total", "Renewals of the coordinator lease that failed.", prometheus.CounterValue, nil}
	mTable           = metricDesc{"natshard_coordinator_shards", "Shards of the leader's table by state (active, parked, handoff, binding, unowned); 0 where this node does not lead.", prometheus.GaugeValue, []string{"state"}}
	mStarted         = metricDesc{"natshard_handoffs_started_total", "Moves of live shards the leader began (HandOff sent).", prometheus.CounterValue, nil}
	mCompleted       = metricDesc{"natshard_handoffs_completed_total", "Moves that ended as planned: the source paused and was released, the target went active.", prometheus.CounterValue, nil}
	mTimedOut        = metricDesc{"natshard_handoffs_timed_out_total", "Moves whose source did not pause within the handoff timeout: dropped there and reallocated.", prometheus.CounterValue, nil}
	mForced          = metricDesc{"natshard_handoffs_forced_total", "Moves whose source was lost during the move: the coordinator took the shard over.", prometheus.CounterValue, nil}
	mRounds          = metricDesc{"natshard_rebalance_rounds_total", "Rebalance rounds that moved shards.", prometheus.CounterValue, nil}
	mRoundMoves      = metricDesc{"natshard_rebalance_moves_total", "Moves started by rebalance rounds.", prometheus.CounterValue, nil}
	mParked          = metricDesc{"natshard_coordinator_messages_parked_total", "Messages of parked shards (no live owner) the leader appended to the buffer.", prometheus.CounterValue, nil}
	mParkRefused     = metricDesc{"natshard_coordinator_messages_refused_total", "Of the parked messages, those the buffer refused (full, or an error): answered with an error until the shard's bind was sent, not answered after (its bound owner answers its own copy).", prometheus.CounterValue, nil}

	// Durable delivery: read from the stream's info at scrape time.
	mStreamMsgs = metricDesc{"natshard_durable_stream_messages", "Messages stored in the type's message streams together (durable delivery): not yet handled and acknowledged. The same for every process of the type.", prometheus.GaugeValue, nil}

	regionMetrics = []metricDesc{mDelivered, mRefused, mHandled, mFailed, mBuffered, mReplayed, mHeld, mDupes, mOldSubject,
		mActivations, mPassivations, mOverLimit, mRestarts, mActive, mRegionShards, mRegistered, mFenced, mSuspended, mStalls, mSourceFenced, mRegionRenewFails, mCommandsRefused,
		mStreamMsgs}
	coordinatorMetrics = []metricDesc{mLeader, mEpoch, mTerms, mCoordRenewFails, mTable, mStarted, mCompleted, mTimedOut, mForced,
		mRounds, mRoundMoves, mParked, mParkRefused}
)

// stepMetric is the histogram's name.
const stepMetric = "natshard_handoff_duration_seconds"

// MetricNames lists the names of the metrics a node exports (a histogram
// by its base name), for dashboards and their tests.
func MetricNames() []string {
	var out []string
	for _, d := range append(append([]metricDesc(nil), regionMetrics...), coordinatorMetrics...) {
		out = append(out, d.name)
	}
	return append(out, stepMetric)
}

// metrics are a node's collectors.
type metrics struct {
	node  *Node
	reg   prometheus.Registerer
	descs map[string]*prometheus.Desc
	steps *prometheus.HistogramVec
}

// newMetrics makes the collectors of n and registers them in reg.
func newMetrics(n *Node, reg prometheus.Registerer) (*metrics, error) {
	constLabels := prometheus.Labels{"region": n.opts.Region}
	m := &metrics{node: n, reg: reg, descs: map[string]*prometheus.Desc{}}
	for _, d := range append(append([]metricDesc(nil), regionMetrics...), coordinatorMetrics...) {
		m.descs[d.name] = prometheus.NewDesc(d.name, d.help, append([]string{"type"}, d.labels...), constLabels)
	}
	m.steps = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:        stepMetric,
		Help:        "Durations of handoff steps: pause, bind and move as the coordinator leader saw them; stop (at the source) and replay (at the target) as the regions did.",
		ConstLabels: constLabels, Buckets: DefaultStepBuckets,
	}, []string{"type", "step"})
	if err := reg.Register(m); err != nil {
		return nil, err
	}
	if err := reg.Register(m.steps); err != nil {
		reg.Unregister(m)
		return nil, err
	}
	return m, nil
}

// unregister removes the collectors (the node stopped).
func (m *metrics) unregister() {
	m.reg.Unregister(m)
	m.reg.Unregister(m.steps)
}

// observe records a step's duration; m may be nil.
func (m *metrics) observe(typ, step string, d time.Duration) {
	if m != nil && d >= 0 {
		m.steps.WithLabelValues(typ, step).Observe(d.Seconds())
	}
}

// Describe implements prometheus.Collector.
func (m *metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range m.descs {
		ch <- d
	}
}

// Collect implements prometheus.Collector: it reads the counters of each
// hosted type.
func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	for _, h := range m.node.hostedTypes() {
		if h.agent != nil {
			m.collectRegion(ch, h.t.Name, h.agent)
			if h.stream != nil {
				m.collectStream(ch, h.t.Name, h.stream)
			}
		}
		if h.coordStats != nil {
			m.collectCoordinator(ch, h.t.Name, h.coordStats)
		}
	}
}

func (m *metrics) emit(ch chan<- prometheus.Metric, d metricDesc, v float64, labels ...string) {
	ch <- prometheus.MustNewConstMetric(m.descs[d.name], d.kind, v, labels...)
}

// streamInfoTimeout bounds the stream info request of a scrape.
const streamInfoTimeout = 2 * time.Second

// collectStream reports the stream's size; nothing when JetStream does
// not answer in time (the scrape goes on without it).
func (m *metrics) collectStream(ch chan<- prometheus.Metric, typ string, s *kvstate.Stream) {
	ctx, cancel := context.WithTimeout(context.Background(), streamInfoTimeout)
	defer cancel()
	if n, err := s.Messages(ctx); err == nil {
		m.emit(ch, mStreamMsgs, float64(n), typ)
	}
}

func (m *metrics) collectRegion(ch chan<- prometheus.Metric, typ string, a *region.Agent) {
	s := a.Stats()
	e := a.EntityCounts()
	st := a.Status()
	// BufferFull is counted after BufferFailed: read it first, so that
	// the difference is never negative.
	full := s.BufferFull.Load()
	bufferErrors := s.BufferFailed.Load() - full
	for _, r := range []struct {
		reason string
		n      uint64
	}{
		{"malformed", s.Malformed.Load()}, {"not_owned", s.NotOwned.Load()},
		{"buffer_full", full}, {"buffer_error", bufferErrors},
		{"held_limit", s.HeldOverflow.Load()}, {"stopping", e.RefusedStopping},
	} {
		m.emit(ch, mRefused, float64(r.n), typ, r.reason)
	}
	for _, c := range []struct {
		d metricDesc
		n uint64
	}{
		{mDelivered, e.Delivered}, {mHandled, e.Handled}, {mFailed, e.Failed},
		{mBuffered, s.Buffered.Load()}, {mReplayed, s.Replayed.Load()}, {mHeld, s.Held.Load()},
		{mDupes, s.DuplicatesSkipped.Load()}, {mOldSubject, s.OldSubject.Load()}, {mActivations, e.Activations}, {mPassivations, e.Passivations}, {mOverLimit, e.OverLimit},
		{mRestarts, s.Restarted.Load()},
		{mFenced, s.Fenced.Load()}, {mSuspended, s.Suspended.Load()}, {mStalls, s.Stalls.Load()}, {mSourceFenced, s.SourceFenced.Load()}, {mRegionRenewFails, s.RenewalsFailed.Load()}, {mCommandsRefused, s.Refused.Load()},
	} {
		m.emit(ch, c.d, float64(c.n), typ)
	}
	m.emit(ch, mActive, float64(e.Active), typ)
	m.emit(ch, mRegionShards, float64(st.Replaying), typ, "replaying")
	m.emit(ch, mRegionShards, float64(st.Live), typ, "live")
	m.emit(ch, mRegionShards, float64(st.Paused), typ, "paused")
	m.emit(ch, mRegionShards, float64(st.Suspended), typ, "suspended")
	m.emit(ch, mRegistered, bool01(st.Registered), typ)
}

func (m *metrics) collectCoordinator(ch chan<- prometheus.Metric, typ string, s *coordinator.Stats) {
	m.emit(ch, mLeader, bool01(s.Leading.Load()), typ)
	m.emit(ch, mEpoch, float64(s.Epoch.Load()), typ)
	for st, n := range s.Shards() {
		m.emit(ch, mTable, float64(n), typ, string(st))
	}
	for _, c := range []struct {
		d metricDesc
		n uint64
	}{
		{mTerms, s.Terms.Load()}, {mCoordRenewFails, s.RenewalsFailed.Load()},
		{mStarted, s.HandOffsStarted.Load()}, {mCompleted, s.HandOffsCompleted.Load()},
		{mTimedOut, s.HandOffsTimedOut.Load()}, {mForced, s.HandOffsForced.Load()},
		{mRounds, s.Rounds.Load()}, {mRoundMoves, s.RoundMoves.Load()},
		{mParked, s.ParkedMessages.Load()}, {mParkRefused, s.ParkRefused.Load()},
	} {
		m.emit(ch, c.d, float64(c.n), typ)
	}
}

func bool01(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
