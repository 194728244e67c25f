package send

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
)

// ask is r.request of a new request (no token yet).
func (r *replies) ask(ctx context.Context, m *nats.Msg, until time.Time) (*nats.Msg, error) {
	a, _, err := r.request(ctx, m, until, 0)
	return a, err
}

// TestRepliesTokensUnpredictable: a request's reply token says nothing
// of the next one's, so that a region that serves one request cannot
// answer the next request of the connection before its entity does; and
// the reply subjects are on the connection's inbox, its
// nats.CustomInboxPrefix applying (GUIDE says so).
func TestRepliesTokensUnpredictable(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	responder := natstest.Connect(t, url)
	subjects := make(chan string, 100)
	if _, err := responder.Subscribe("echo", func(m *nats.Msg) {
		subjects <- m.Reply
		_ = m.Respond(nil)
	}); err != nil {
		t.Fatal(err)
	}
	if err := responder.Flush(); err != nil {
		t.Fatal(err)
	}
	r := &replies{nc: natstest.Connect(t, url, nats.CustomInboxPrefix("_INBOX_mine"))}
	var tokens []uint64
	for range 50 {
		if _, err := r.ask(context.Background(), &nats.Msg{Subject: "echo"}, time.Now().Add(10*time.Second)); err != nil {
			t.Fatal(err)
		}
		reply := <-subjects
		if !strings.HasPrefix(reply, "_INBOX_mine.") {
			t.Fatalf("reply subject %q is not on the connection's inbox prefix _INBOX_mine", reply)
		}
		digits, marked := strings.CutPrefix(reply[strings.LastIndexByte(reply, '.')+1:], protocol.UniqueReplyMark)
		if !marked {
			t.Fatalf("reply subject %q is not marked unique (protocol.UniqueReplyMark)", reply)
		}
		tok, err := strconv.ParseUint(digits, 36, 64)
		if err != nil {
			t.Fatalf("reply subject %q: %v", reply, err)
		}
		tokens = append(tokens, tok)
	}
	near := 0
	for i := 1; i < len(tokens); i++ {
		if d := int64(tokens[i] - tokens[i-1]); d >= -1000 && d <= 1000 {
			near++
		}
	}
	if near > 0 {
		t.Fatalf("%d of %d reply tokens within 1000 of the one before: %d", near, len(tokens)-1, tokens)
	}
}

// TestRepliesRouteAnswers: concurrent requests each get their own answer,
// an answer that comes after its request gave up reaches no later one,
// and the ends of a wait (its bound, its context, no responders, the
// connection closed) are told apart. Real NATS: the routing is by the
// reply subjects the server delivers.
func TestRepliesRouteAnswers(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	responder := natstest.Connect(t, url)
	late := make(chan *nats.Msg, 1)
	if _, err := responder.Subscribe("echo.*", func(m *nats.Msg) {
		if m.Subject == "echo.late" {
			late <- m // answered when the test says
			return
		}
		_ = m.Respond(m.Data)
	}); err != nil {
		t.Fatal(err)
	}
	if err := responder.Flush(); err != nil {
		t.Fatal(err)
	}
	nc := natstest.Connect(t, url)
	r := &replies{nc: nc}
	ctx := context.Background()
	soon := func() time.Time { return time.Now().Add(10 * time.Second) }

	var wg sync.WaitGroup
	for i := range 64 {
		wg.Go(func() {
			for j := range 50 {
				body := strconv.Itoa(i) + "/" + strconv.Itoa(j)
				a, err := r.ask(ctx, &nats.Msg{Subject: "echo.x", Data: []byte(body)}, soon())
				if err != nil || string(a.Data) != body {
					t.Errorf("request %s: answer %v, %v", body, a, err)
					return
				}
			}
		})
	}
	wg.Wait()
	if n := len(r.waiting); n != 0 {
		t.Errorf("%d requests still registered after all were answered", n)
	}

	// A request that gave up; its answer comes during the next request,
	// which must get its own.
	if _, err := r.ask(ctx, &nats.Msg{Subject: "echo.late", Data: []byte("first")}, time.Now().Add(50*time.Millisecond)); !errors.Is(err, errNoAnswer) {
		t.Fatalf("request past its bound: %v", err)
	}
	first := <-late
	if err := first.Respond([]byte("first's answer")); err != nil {
		t.Fatal(err)
	}
	if a, err := r.ask(ctx, &nats.Msg{Subject: "echo.x", Data: []byte("second")}, soon()); err != nil || string(a.Data) != "second" {
		t.Fatalf("the request after one that gave up: %v, %v", a, err)
	}

	// A request sent again with its token has its reply subject (its
	// key), and an answer to the attempt that gave up ends its wait.
	m := &nats.Msg{Subject: "echo.late", Data: []byte("again")}
	_, token, err := r.request(ctx, m, time.Now().Add(50*time.Millisecond), 0)
	if !errors.Is(err, errNoAnswer) {
		t.Fatalf("request past its bound: %v", err)
	}
	firstReply := m.Reply
	<-late
	go func() {
		sent := <-late // the attempt below; the first's is answered
		if sent.Reply != firstReply {
			t.Errorf("sent again to reply subject %q, first to %q", sent.Reply, firstReply)
		}
		if err := responder.Publish(firstReply, []byte("again's answer")); err != nil {
			t.Error(err)
		}
	}()
	if a, again, err := r.request(ctx, m, soon(), token); err != nil || string(a.Data) != "again's answer" || again != token {
		t.Fatalf("the request sent again: %v, %v (token %d, first %d)", a, err, again, token)
	}

	cctx, cancel := context.WithCancel(ctx)
	time.AfterFunc(20*time.Millisecond, cancel)
	if _, err := r.ask(cctx, &nats.Msg{Subject: "echo.late"}, time.Time{}); !errors.Is(err, context.Canceled) {
		t.Fatalf("request whose context was cancelled: %v", err)
	}
	<-late
	// Nothing is sent for a call that has ended already.
	ended, cancelEnded := context.WithCancel(ctx)
	cancelEnded()
	if _, err := r.ask(ended, &nats.Msg{Subject: "echo.late"}, time.Time{}); !errors.Is(err, context.Canceled) {
		t.Fatalf("request with an ended context: %v", err)
	}
	if _, err := r.ask(ctx, &nats.Msg{Subject: "echo.late"}, time.Now().Add(-time.Second)); !errors.Is(err, errNoAnswer) {
		t.Fatalf("request past its bound before it began: %v", err)
	}
	select {
	case m := <-late:
		t.Fatalf("a request that had ended was sent: %v", m)
	case <-time.After(100 * time.Millisecond):
	}
	if _, err := r.ask(ctx, &nats.Msg{Subject: "nobody.here"}, soon()); !errors.Is(err, nats.ErrNoResponders) {
		t.Fatalf("request nobody listens to: %v", err)
	}

	// The connection closes while a request waits without a bound: it
	// returns then, and the next fails at once.
	done := make(chan error, 1)
	go func() {
		_, err := r.ask(ctx, &nats.Msg{Subject: "echo.late"}, time.Time{})
		done <- err
	}()
	<-late
	nc.Close()
	waitClosed(t, done, "a request")
	if _, err := r.ask(ctx, &nats.Msg{Subject: "echo.x"}, soon()); !errors.Is(err, nats.ErrConnectionClosed) {
		t.Fatalf("request on a closed connection: %v", err)
	}
}

// TestRepliesNoStaleAnswer: requests that give up while their answer is
// on its way (bounds of 1 us to 33 ms) never leave that answer for
// a later request: each answer a request gets is its own.
func TestRepliesNoStaleAnswer(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	responder := natstest.Connect(t, url)
	if _, err := responder.Subscribe("echo", func(m *nats.Msg) { _ = m.Respond(m.Data) }); err != nil {
		t.Fatal(err)
	}
	if err := responder.Flush(); err != nil {
		t.Fatal(err)
	}
	r := &replies{nc: natstest.Connect(t, url)}
	var wg sync.WaitGroup
	var answered, gaveUp atomic.Int64
	for i := range 32 {
		wg.Go(func() {
			for j := range 300 {
				body := strconv.Itoa(i) + "/" + strconv.Itoa(j)
				// 1 us to 33 ms: some give up as their answer comes,
				// whatever the machine's load (a spread of 0-1 ms had
				// every request give up under CI's load).
				bound := time.Now().Add(time.Duration(1<<(j%16)) * time.Microsecond)
				a, err := r.ask(context.Background(), &nats.Msg{Subject: "echo", Data: []byte(body)}, bound)
				switch {
				case errors.Is(err, errNoAnswer):
					gaveUp.Add(1)
				case err != nil:
					t.Errorf("request %s: %v", body, err)
					return
				case string(a.Data) != body:
					t.Errorf("request %s got the answer to %s", body, a.Data)
					return
				default:
					answered.Add(1)
				}
			}
		})
	}
	wg.Wait()
	if answered.Load() == 0 || gaveUp.Load() == 0 {
		t.Fatalf("%d answered, %d gave up: the test needs both", answered.Load(), gaveUp.Load())
	}
}

// TestRepliesInbox: a durable request's inbox (open) takes every message
// sent to it, in order, however many and however fast, until it is
// closed (a refusal, then its next owner's answer, then the answer to
// an ask for it must all come); a closed inbox takes nothing more, and
// another inbox or a core request never gets its messages; the
// connection closing ends a wait.
func TestRepliesInbox(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	nc := natstest.Connect(t, url)
	sender := natstest.Connect(t, url)
	r := &replies{nc: nc}
	a, err := r.open()
	if err != nil {
		t.Fatal(err)
	}
	b, err := r.open()
	if err != nil {
		t.Fatal(err)
	}
	if a.subject == b.subject || !strings.HasPrefix(a.subject, r.prefix) {
		t.Fatalf("inboxes %q and %q (prefix %q)", a.subject, b.subject, r.prefix)
	}
	// The subscription reaches the server before sender's messages do (a
	// request publishes on nc itself, after its subscription).
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	const n = 1000 // sent at once, before a reads any
	for i := range n {
		if err := sender.Publish(a.subject, []byte(strconv.Itoa(i))); err != nil {
			t.Fatal(err)
		}
	}
	if err := sender.Publish(b.subject, []byte("b's")); err != nil {
		t.Fatal(err)
	}
	if err := sender.Flush(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i := range n {
		m, err := a.next(ctx)
		if err != nil || string(m.Data) != strconv.Itoa(i) {
			t.Fatalf("message %d to the inbox: %v, %v", i, m, err)
		}
	}
	if m, err := b.next(ctx); err != nil || string(m.Data) != "b's" {
		t.Fatalf("the other inbox's message: %v, %v", m, err)
	}
	short, cancelShort := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancelShort()
	if m, err := a.next(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("an inbox with nothing more: %v, %v", m, err)
	}

	// Closed: what comes is dropped, and a core request of the
	// connection, whose token may be anything, is answered its own.
	a.close()
	if err := sender.Publish(a.subject, []byte("late")); err != nil {
		t.Fatal(err)
	}
	if err := sender.Flush(); err != nil {
		t.Fatal(err)
	}
	if _, err := sender.Subscribe("echo", func(m *nats.Msg) { _ = m.Respond(m.Data) }); err != nil {
		t.Fatal(err)
	}
	if err := sender.Flush(); err != nil {
		t.Fatal(err)
	}
	if m, err := r.ask(ctx, &nats.Msg{Subject: "echo", Data: []byte("core")}, time.Now().Add(10*time.Second)); err != nil || string(m.Data) != "core" {
		t.Fatalf("a core request after the inbox closed: %v, %v", m, err)
	}
	a.mu.Lock()
	left := len(a.got)
	a.mu.Unlock()
	r.mu.Lock()
	open := len(r.inboxes)
	r.mu.Unlock()
	if left != 0 || open != 1 {
		t.Fatalf("after close: %d messages kept by the closed inbox, %d inboxes open (want 0, 1)", left, open)
	}

	// The connection closes while b waits.
	done := make(chan error, 1)
	go func() {
		_, err := b.next(context.Background())
		done <- err
	}()
	nc.Close()
	waitClosed(t, done, "an inbox")
	if _, err := r.open(); !errors.Is(err, nats.ErrConnectionClosed) {
		t.Fatalf("an inbox on a closed connection: %v", err)
	}
}

// waitClosed checks that what, waiting when its connection closed, ended
// with nats.ErrConnectionClosed (sent on done) within 10 s.
func waitClosed(t *testing.T, done <-chan error, what string) {
	t.Helper()
	select {
	case err := <-done:
		if !errors.Is(err, nats.ErrConnectionClosed) {
			t.Fatalf("%s waiting when the connection closed: %v", what, err)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("%s waiting when the connection closed still waits", what)
	}
}
