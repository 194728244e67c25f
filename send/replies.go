package send

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard/protocol"
)

// replies routes the answers to the core requests of the clients of a
// connection, as nats.go's own request multiplexer does: one subscription
// on <inbox>.* for all of them (shared by every Client of the connection:
// repliesOf), and each request waiting on a channel under a token of its
// own. A request's reply subject is <inbox>.~<token>: marked unique
// (protocol.UniqueReplyMark), it is the request's key, so the request
// needs no Nats-Msg-Id header.
//
// It differs in what it costs a request (issue 14: with 64 callers, a
// Client's requests took 2.5 times the CPU of nc.Request's): its own mutex
// rather than the connection's, held only for a map insert and delete;
// the token a random number; the channel and the timer reused; and the call's
// bound a time, not a context made (and its timer started) per request.
//
// A durable request's answers come to it too, on an inbox of the same
// form that stays open until the request ends (open): a subscription per
// request cost a SUB and an UNSUB, and nats.go's SubscribeSync makes a
// channel of 65 536 message pointers (512 KiB) for each, which the
// garbage collector scans while the request waits: with 64 callers,
// making them took a quarter of the CPU of a process that ran the server
// and the regions too, and collecting them more; under an open load the
// requests waiting held ever more of them, and the answers came seconds
// late (issue 34, docs/bench-log/durable-best-shape.md).
type replies struct {
	nc *nats.Conn

	mu      sync.Mutex
	sub     *nats.Subscription // nil until the first request, and after the connection closed
	prefix  string             // "<inbox>.~": a token follows
	waiting map[uint64]chan *nats.Msg
	inboxes map[uint64]*inbox // durable requests' (open)
	gone    chan struct{}     // closed when sub ended: the connection closed
}

// muxes holds the replies of each connection that has one: made at a
// Client's first core request, forgotten when the connection closes (a
// Client made per call does not add a subscription each time).
var muxes sync.Map // *nats.Conn -> *replies

// repliesOf returns the replies of nc, made if it has none.
func repliesOf(nc *nats.Conn) *replies {
	if r, ok := muxes.Load(nc); ok {
		return r.(*replies)
	}
	r, _ := muxes.LoadOrStore(nc, &replies{nc: nc})
	return r.(*replies)
}

// errNoAnswer: a request's answer did not come before its bound.
var errNoAnswer = errors.New("no answer in time")

// answers are the channels requests wait on (capacity 1, empty). One is
// put back only by the request that received from it: a request that
// gave up may still be sent an answer on its channel.
var answers = sync.Pool{New: func() any { return make(chan *nats.Msg, 1) }}

// timers are stopped timers with nothing in their channel, reset for one
// wait each.
var timers sync.Pool

// request publishes m, its Reply the subject of token (0, or a token
// waited on by another request: a new random one), and waits for the
// answer until ctx ends (ctx.Err()) or until passes (errNoAnswer; a zero
// until: no bound but ctx). It returns the token it used: a request sent
// again gives it back, so that every attempt has one reply subject, its
// key (protocol.MessageKey), and an answer to any attempt ends the wait.
// The server's "no responders" status is nats.ErrNoResponders, and a
// connection closed meanwhile nats.ErrConnectionClosed. Nothing is sent
// when ctx has ended or until has passed already.
func (r *replies) request(ctx context.Context, m *nats.Msg, until time.Time, token uint64) (*nats.Msg, uint64, error) {
	if err := ctx.Err(); err != nil {
		return nil, token, err
	}
	var left time.Duration // until's, read once
	if !until.IsZero() {
		if left = time.Until(until); left <= 0 {
			return nil, token, errNoAnswer
		}
	}
	ch := answers.Get().(chan *nats.Msg)
	token, gone, err := r.expect(ch, token)
	if err != nil {
		answers.Put(ch)
		return nil, token, err
	}
	m.Reply = r.subject(token)
	if err := r.nc.PublishMsg(m); err != nil {
		r.forget(token)
		return nil, token, err
	}
	var expired <-chan time.Time
	if !until.IsZero() {
		t, _ := timers.Get().(*time.Timer)
		if t == nil {
			t = time.NewTimer(left)
		} else {
			t.Reset(left)
		}
		defer func() {
			if !t.Stop() {
				// Expired: its tick was taken, unless a process run
				// with GODEBUG=asynctimerchan=1 (timers as before Go
				// 1.23) left it in the channel.
				select {
				case <-t.C:
				default:
				}
			}
			timers.Put(t)
		}()
		expired = t.C
	}
	select {
	case a := <-ch:
		answers.Put(ch)
		if len(a.Data) == 0 && a.Header.Get("Status") == "503" {
			return nil, token, nats.ErrNoResponders
		}
		return a, token, nil
	case <-expired:
		err = errNoAnswer
	case <-ctx.Done():
		err = ctx.Err()
	case <-gone:
		err = nats.ErrConnectionClosed
	}
	r.forget(token)
	return nil, token, err
}

// expect registers ch under token, or under a new one when token is 0 or
// taken, subscribing first if r has no subscription yet. It returns the
// token and the channel closed when the subscription ends.
func (r *replies) expect(ch chan *nats.Msg, token uint64) (uint64, <-chan struct{}, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.subscribeLocked(); err != nil {
		return 0, nil, err
	}
	token = r.tokenLocked(token)
	r.waiting[token] = ch
	return token, r.gone, nil
}

// subscribeLocked subscribes r (r.mu held), unless it is subscribed.
func (r *replies) subscribeLocked() error {
	if r.sub != nil {
		return nil
	}
	if r.nc.IsClosed() {
		muxes.CompareAndDelete(r.nc, r)
		return nats.ErrConnectionClosed
	}
	prefix := r.nc.NewInbox()
	sub, err := r.nc.Subscribe(prefix+".*", r.deliver)
	if err != nil {
		return err
	}
	gone := make(chan struct{})
	sub.SetClosedHandler(func(string) { r.closed(gone) })
	r.sub, r.prefix, r.gone = sub, prefix+"."+protocol.UniqueReplyMark, gone
	if r.waiting == nil {
		r.waiting, r.inboxes = map[uint64]chan *nats.Msg{}, map[uint64]*inbox{}
	}
	return nil
}

// tokenLocked is token if it is not 0 and no request waits under it, or
// else a new one (r.mu held). A random token, as nats.go's own: whoever
// sees one reply subject (a region serving the request) cannot tell the
// next one's, to answer it before its entity does. math/rand/v2's
// source is ChaCha8, seeded by the system.
func (r *replies) tokenLocked(token uint64) uint64 {
	for token == 0 || r.waiting[token] != nil || r.inboxes[token] != nil {
		token = rand.Uint64()
	}
	return token
}

// subject is the reply subject of token (r.prefix set).
func (r *replies) subject(token uint64) string {
	var digits [13]byte // the token's, without a string of their own
	return r.prefix + string(strconv.AppendUint(digits[:0], token, 36))
}

// inbox is a durable request's reply subject on the connection's
// subscription, and the messages that came to it: any number, until
// the request closes it (a refusal and then the next owner's answer,
// the answers to the request's asks for its answer: askAnswer).
type inbox struct {
	r       *replies
	token   uint64
	subject string
	gone    <-chan struct{} // the connection closed

	mu    sync.Mutex
	got   []*nats.Msg
	ready chan struct{} // holds a tick while got is not empty
}

// open returns a new inbox, subscribing r first if it is not.
func (r *replies) open() (*inbox, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.subscribeLocked(); err != nil {
		return nil, err
	}
	ib := &inbox{r: r, token: r.tokenLocked(0), gone: r.gone, ready: make(chan struct{}, 1)}
	ib.subject = r.subject(ib.token)
	r.inboxes[ib.token] = ib
	return ib, nil
}

// put adds m to what came; it never waits.
func (ib *inbox) put(m *nats.Msg) {
	ib.mu.Lock()
	ib.got = append(ib.got, m)
	ib.mu.Unlock()
	select {
	case ib.ready <- struct{}{}:
	default:
	}
}

// next returns the first message that came and is not returned yet,
// waiting for one until ctx ends (ctx.Err()) or the connection closes
// (nats.ErrConnectionClosed).
func (ib *inbox) next(ctx context.Context) (*nats.Msg, error) {
	for {
		ib.mu.Lock()
		if len(ib.got) > 0 {
			m := ib.got[0]
			ib.got = ib.got[1:]
			ib.mu.Unlock()
			return m, nil
		}
		ib.mu.Unlock()
		select {
		case <-ib.ready:
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-ib.gone:
			return nil, nats.ErrConnectionClosed
		}
	}
}

// close ends the inbox: what comes to it from now on is dropped.
func (ib *inbox) close() {
	ib.r.mu.Lock()
	if ib.r.inboxes[ib.token] == ib {
		delete(ib.r.inboxes, ib.token)
	}
	ib.r.mu.Unlock()
}

// forget drops token's channel: its request no longer waits.
func (r *replies) forget(token uint64) {
	r.mu.Lock()
	delete(r.waiting, token)
	r.mu.Unlock()
}

// deliver is the subscription's handler: the answer goes to the request
// waiting under the subject's token, if one still is.
func (r *replies) deliver(m *nats.Msg) {
	digits, ok := strings.CutPrefix(m.Subject[strings.LastIndexByte(m.Subject, '.')+1:], protocol.UniqueReplyMark)
	if !ok {
		return
	}
	token, err := strconv.ParseUint(digits, 36, 64)
	if err != nil {
		return
	}
	r.mu.Lock()
	ch, ok := r.waiting[token]
	delete(r.waiting, token)
	ib := r.inboxes[token]
	r.mu.Unlock()
	switch {
	case ok:
		ch <- m // never blocks: one answer per token, to an empty channel
	case ib != nil:
		ib.put(m)
	}
}

// closed runs when the subscription ended (the connection closed): the
// waiting requests return, the connection's replies are forgotten, and a
// later request fails (the connection being closed).
func (r *replies) closed(gone chan struct{}) {
	r.mu.Lock()
	if r.gone == gone {
		r.sub, r.gone = nil, nil
	}
	r.mu.Unlock()
	muxes.CompareAndDelete(r.nc, r)
	close(gone)
}
