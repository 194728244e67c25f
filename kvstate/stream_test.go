package kvstate_test

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// TestStream runs the message stream's tests (durable delivery) against
// a single server (R1) and a three-server cluster (R3), with the type's
// messages in a single stream and split over 4 streams (8 shards, split
// to 16 by testStreamForward).
func TestStream(t *testing.T) {
	for _, replicas := range []int{1, 3} {
		for _, streams := range []int{1, 4} {
			t.Run(fmt.Sprintf("R%d/streams=%d", replicas, streams), func(t *testing.T) {
				var url string
				if replicas == 1 {
					url = natstest.URL(natstest.RunServer(t))
				} else {
					url = natstest.ClusterURLs(natstest.RunCluster(t, replicas))
				}
				js := natstest.JetStream(t, natstest.Connect(t, url))
				subjects := protocol.MustSubjects("", "", "orders")
				opts := kvstate.StreamOptions{Replicas: replicas, Streams: streams, Shards: 8, Timeout: 10 * time.Second}
				s, err := kvstate.OpenStream(testCtx(t), js, subjects, opts)
				if err != nil {
					t.Fatal(err)
				}
				if want := kvstate.MessageStreams("orders", streams); !slices.Equal(s.Names(), want) {
					t.Fatalf("streams %q, want %q", s.Names(), want)
				}
				// A process opening it again binds it.
				opts.Timeout = 0
				if _, err := kvstate.OpenStream(testCtx(t), js, subjects, opts); err != nil {
					t.Fatal(err)
				}
				testStreamReset(t, js, s, subjects)
				testStreamFirstOf(t, js, s, subjects)
				testStreamReminders(t, js, s, subjects)
				testStreamForward(t, js, s, subjects)
			})
		}
	}
}

// publish stores messages for shard with data "<tag>-<i>", the first
// twice (same Nats-Msg-Id), and returns their sequences.
func publish(t *testing.T, js jetstream.JetStream, subjects protocol.Subjects, shard, n int, tag string) []uint64 {
	t.Helper()
	var seqs []uint64
	for i := range n {
		m := nats.NewMsg(subjects.Entity(shard, fmt.Sprintf("e%d", i%3)))
		m.Data = fmt.Appendf(nil, "%s-%d", tag, i)
		m.Header.Set(protocol.HeaderMsgID, string(m.Data))
		ack, err := js.PublishMsg(testCtx(t), m)
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			if again, err := js.PublishMsg(testCtx(t), m); err != nil || !again.Duplicate || again.Sequence != ack.Sequence {
				t.Fatalf("publish again with the same Nats-Msg-Id: %+v, %v", again, err)
			}
		}
		seqs = append(seqs, ack.Sequence)
	}
	return seqs
}

// next pulls one message through it, within a few seconds.
func next(t *testing.T, it jetstream.MessagesContext) jetstream.Msg {
	t.Helper()
	m, err := it.Next(jetstream.NextMaxWait(10 * time.Second))
	if err != nil {
		t.Fatalf("next: %v", err)
	}
	return m
}

// testStreamReset: a shard's consumer delivers the shard's messages only,
// in order; acknowledged ones leave the stream; a new owner's reset
// delivers at once what is left (unacknowledged ones included) and cuts
// the previous consumer.
func testStreamReset(t *testing.T, js jetstream.JetStream, s *kvstate.Stream, subjects protocol.Subjects) {
	seqs := publish(t, js, subjects, 1, 4, "a")
	publish(t, js, subjects, 2, 2, "other")
	c, err := s.ResetConsumer(testCtx(t), 1)
	if err != nil {
		t.Fatal(err)
	}
	// Its state is in memory (no file written ten times a second): what
	// matters is in the work queue already.
	if cfg := c.CachedInfo().Config; !cfg.MemoryStorage || cfg.AckPolicy != jetstream.AckExplicitPolicy {
		t.Fatalf("consumer %+v, want stored in memory, explicit acks", cfg)
	}
	it, err := c.Messages(jetstream.PullMaxMessages(10))
	if err != nil {
		t.Fatal(err)
	}
	var got []jetstream.Msg
	for range 4 {
		got = append(got, next(t, it))
	}
	for i, m := range got {
		md, err := m.Metadata()
		if err != nil || md.Sequence.Stream != seqs[i] || string(m.Data()) != fmt.Sprintf("a-%d", i) {
			t.Fatalf("message %d: %q at %+v, %v; want a-%d at %d", i, m.Data(), md, err, i, seqs[i])
		}
	}
	// The first two are handled (the second acknowledged synchronously,
	// a barrier for the first's); the owner dies with the others.
	if err := got[0].Ack(); err != nil {
		t.Fatal(err)
	}
	if err := got[1].DoubleAck(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if err := s.WaitRemoved(testCtx(t), 1, seqs[1]); err != nil {
		t.Fatal(err)
	}
	if n, err := s.Pending(testCtx(t), 1); err != nil || n != 2 {
		t.Fatalf("Pending(1) = %d, %v; want 2", n, err)
	}
	c2, err := s.ResetConsumer(testCtx(t), 1)
	if err != nil {
		t.Fatal(err)
	}
	// The previous owner's consumer is gone.
	if _, err := it.Next(jetstream.NextMaxWait(5 * time.Second)); err == nil {
		t.Fatal("the replaced consumer still delivers")
	}
	it.Stop()
	it2, err := c2.Messages()
	if err != nil {
		t.Fatal(err)
	}
	defer it2.Stop()
	var again []string
	for range 2 {
		m := next(t, it2)
		again = append(again, string(m.Data()))
		if err := m.DoubleAck(testCtx(t)); err != nil {
			t.Fatal(err)
		}
	}
	if !slices.Equal(again, []string{"a-2", "a-3"}) {
		t.Fatalf("after the reset: %q, want the two not acknowledged", again)
	}
	if err := s.WaitRemoved(testCtx(t), 1, seqs[3]); err != nil {
		t.Fatal(err)
	}
	if n, err := s.Pending(testCtx(t), 1); err != nil || n != 0 {
		t.Fatalf("Pending(1) after all were handled = %d, %v", n, err)
	}
	if n, err := s.Pending(testCtx(t), 2); err != nil || n != 2 {
		t.Fatalf("Pending(2) = %d, %v; want 2", n, err)
	}
	if _, err := s.ResetConsumer(testCtx(t), -1); err == nil {
		t.Fatal("ResetConsumer(-1) succeeded")
	}
}

// testStreamReminders: a reminder comes as a message on its entity's data
// subject, with its name in a header, once, and not before its time; a
// reminder of the same name replaces the earlier one; a cancelled one
// never comes; the schedules leave the stream once done.
func testStreamReminders(t *testing.T, js jetstream.JetStream, s *kvstate.Stream, subjects protocol.Subjects) {
	ctx := testCtx(t)
	const shard = 5
	c, err := s.ResetConsumer(ctx, shard)
	if err != nil {
		t.Fatal(err)
	}
	it, err := c.Messages()
	if err != nil {
		t.Fatal(err)
	}
	defer it.Stop()
	set := time.Now()
	at := set.Add(1500 * time.Millisecond)
	if err := s.Remind(ctx, shard, "e.1", "later", at, []byte("old")); err != nil {
		t.Fatal(err)
	}
	if err := s.Remind(ctx, shard, "e.1", "later", at, []byte("new")); err != nil { // replaces
		t.Fatal(err)
	}
	if err := s.Remind(ctx, shard, "e.2", "never", set.Add(time.Second), []byte("x")); err != nil {
		t.Fatal(err)
	}
	if err := s.CancelReminder(ctx, shard, "e.2", "never"); err != nil {
		t.Fatal(err)
	}
	for range 2 { // the same reminder twice: stored once, comes once
		if err := s.Remind(ctx, shard, "e.3", "now", set.Add(-time.Hour), []byte("past")); err != nil {
			t.Fatal(err)
		}
	}
	var got []string
	for len(got) < 2 {
		m := next(t, it)
		if m.Subject() == subjects.Entity(shard, "e.1") && time.Now().Before(at) {
			t.Errorf("reminder came %v before its time", time.Until(at))
		}
		got = append(got, m.Subject()+" "+m.Headers().Get(protocol.HeaderReminder)+" "+string(m.Data()))
		if err := m.DoubleAck(ctx); err != nil {
			t.Fatal(err)
		}
	}
	want := []string{subjects.Entity(shard, "e.3") + " now past", subjects.Entity(shard, "e.1") + " later new"}
	if !slices.Equal(got, want) {
		t.Errorf("reminders came as %q, want %q", got, want)
	}
	if m, err := it.Next(jetstream.NextMaxWait(1500 * time.Millisecond)); err == nil {
		t.Errorf("another reminder came: %s %q", m.Subject(), m.Data())
	}
	st, err := js.Stream(ctx, kvstate.ReminderStream(subjects.Type()))
	if err != nil {
		t.Fatal(err)
	}
	if info, err := st.Info(ctx); err != nil || info.State.Msgs != 0 {
		t.Errorf("the reminders' stream holds %+v, %v; want nothing: the schedules fired and the messages were taken", info.State, err)
	}
	if err := s.Remind(ctx, shard, "e.1", "bad name", at, nil); err == nil {
		t.Error("a reminder name with a space was taken")
	}
}

// TestStreamWithoutSchedules: a reminders' stream made without message
// schedules (by hand, or on a server older than 2.12) is used, and
// Remind says that it cannot keep reminders.
func TestStreamWithoutSchedules(t *testing.T) {
	js := natstest.JetStream(t, natstest.Connect(t, natstest.URL(natstest.RunServer(t))))
	subjects := protocol.MustSubjects("", "", "old")
	if _, err := js.CreateStream(testCtx(t), jetstream.StreamConfig{
		Name: kvstate.ReminderStream("old"), Subjects: []string{subjects.AllReminders(), subjects.AllFired()}, Retention: jetstream.WorkQueuePolicy,
	}); err != nil {
		t.Fatal(err)
	}
	s, err := kvstate.OpenStream(testCtx(t), js, subjects, kvstate.StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Remind(testCtx(t), 0, "e", "r", time.Now().Add(time.Hour), nil); !errors.Is(err, kvstate.ErrNoSchedules) {
		t.Fatalf("remind on a stream without schedules: %v", err)
	}
}

// testStreamFirstOf: FirstOf is the shard's first message in the stream
// (0 for none), and StartsLate says whether a consumer whose next
// delivery is a sequence skips one of the shard's messages the stream
// holds: what a shard's owner checks a new consumer's start against
// (a consumer whose first leader's copy of the stream was behind starts
// past messages; docs/FAULTS.md, issue 30).
func testStreamFirstOf(t *testing.T, js jetstream.JetStream, s *kvstate.Stream, subjects protocol.Subjects) {
	const shard = 5
	ctx := testCtx(t)
	if first, err := s.FirstOf(ctx, shard); err != nil || first != 0 {
		t.Fatalf("FirstOf of a shard without messages = %d, %v; want 0", first, err)
	}
	seqs := publish(t, js, subjects, shard, 3, "first")
	publish(t, js, subjects, shard+1, 2, "other") // another shard's, after
	first, err := s.FirstOf(ctx, shard)
	if err != nil || first != seqs[0] {
		t.Fatalf("FirstOf = %d, %v; want %d", first, err, seqs[0])
	}
	for _, c := range []struct {
		next uint64
		late bool
	}{{seqs[0], false}, {seqs[0] - 1, false}, {seqs[0] + 1, true}, {seqs[2], true}} {
		if late, err := s.StartsLate(ctx, shard, c.next); err != nil || late != c.late {
			t.Errorf("StartsLate(next %d) with the shard's messages at %v = %v, %v; want %v", c.next, seqs, late, err, c.late)
		}
	}
	// A consumer made for the shard starts at its first message.
	cons, err := s.ResetConsumer(ctx, shard)
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := cons.Fetch(3, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var got []uint64
	for m := range msgs.Messages() {
		md, _ := m.Metadata()
		got = append(got, md.Sequence.Stream)
		if err := m.DoubleAck(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if !slices.Equal(got, seqs) {
		t.Fatalf("the new consumer delivered %v; want %v", got, seqs)
	}
	natstest.Eventually(t, 10*time.Second, "the acknowledged messages removed", func() bool {
		first, err := s.FirstOf(ctx, shard)
		return err == nil && first == 0
	})
}

// testStreamForward: a split's forwarding stores a copy on the child's
// subject with the original's data and headers, its key moved to
// HeaderKey (the original's Nats-Msg-Id would make the stream drop the
// copy), JetStream's own headers dropped; forwarded again (its forwarder
// crashed before acknowledging it), it is stored once.
func testStreamForward(t *testing.T, js jetstream.JetStream, s *kvstate.Stream, subjects protocol.Subjects) {
	ctx := testCtx(t)
	const parent, child = 3, 11 // of 8, of 16
	id := "fw"
	for i := 0; protocol.ShardOf(id, 16) != child; i++ {
		id = fmt.Sprintf("fw%d", i)
	}
	m := nats.NewMsg(subjects.Entity(parent, id))
	m.Data = []byte("payload")
	m.Header.Set(protocol.HeaderMsgID, "key-1")
	m.Header.Set(protocol.HeaderReply, "_INBOX.r")
	m.Header.Set("Nats-Expected-Stream", s.StreamOf(parent))
	ack, err := js.PublishMsg(ctx, m)
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Names()) > 1 {
		// The type splits from 8 to 16 shards: the child's subject is no
		// stream's until Extend adds it (a publish is refused, not lost).
		if err := s.Forward(ctx, m, ack.Sequence, child, id); err == nil {
			t.Fatal("a message on a shard beyond the streams' subjects was stored")
		}
		if err := s.Extend(ctx, 16); err != nil {
			t.Fatal(err)
		}
		if err := s.Extend(ctx, 16); err != nil { // again: nothing to do
			t.Fatal(err)
		}
	}
	for range 2 {
		if err := s.Forward(ctx, m, ack.Sequence, child, id); err != nil {
			t.Fatal(err)
		}
	}
	cons, err := s.ResetConsumer(ctx, child)
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := cons.Fetch(2, jetstream.FetchMaxWait(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var got []jetstream.Msg
	for c := range msgs.Messages() {
		got = append(got, c)
		_ = c.Ack()
	}
	if len(got) != 1 {
		t.Fatalf("%d copies on the child's subject, want 1", len(got))
	}
	c := got[0]
	h := c.Headers()
	if c.Subject() != subjects.Entity(child, id) || string(c.Data()) != "payload" ||
		h.Get(protocol.HeaderKey) != "key-1" || protocol.IdempotencyKey(h) != "key-1" ||
		h.Get(protocol.HeaderReply) != "_INBOX.r" || h.Get(protocol.HeaderForwarded) != fmt.Sprint(ack.Sequence) ||
		h.Get("Nats-Expected-Stream") != "" {
		t.Fatalf("the copy: %s %q %v", c.Subject(), c.Data(), h)
	}
	if err := s.Forward(ctx, m, ack.Sequence, protocol.MaxShards, id); err == nil {
		t.Fatal("Forward to a shard out of range: no error")
	}
}
