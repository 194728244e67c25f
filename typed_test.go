package natshard_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/natshard/natshard"
	cartex "github.com/natshard/natshard/examples/cart"
	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/protocol"
	"github.com/natshard/natshard/send"
)

// The account type of the typed tests: its key and its declared error
// are what a shared package would hold.
type accountReq struct {
	Op     string `json:"op" msgpack:"op"`
	Amount int    `json:"amount,omitempty" msgpack:"amount,omitempty"`
}

type accountRep struct {
	Balance int `json:"balance" msgpack:"balance"`
}

type shortfall struct {
	Missing int `json:"missing" msgpack:"missing"`
}

var (
	accountKey           = natshard.NewKey[accountReq, accountRep]("account")
	errInsufficientFunds = natshard.NewError("insufficient-funds", "insufficient funds")
)

// account is an in-memory account; applied counts the deposits and
// withdrawals it applied, per entity id.
type account struct {
	id      string
	balance int
	applied *sync.Map
}

func (a *account) Handle(_ context.Context, req accountReq) (accountRep, error) {
	switch req.Op {
	case "balance":
	case "deposit":
		a.balance += req.Amount
	case "withdraw":
		if req.Amount > a.balance {
			return accountRep{}, errInsufficientFunds.WithDetails(shortfall{Missing: req.Amount - a.balance})
		}
		a.balance -= req.Amount
	default:
		return accountRep{}, natshard.ErrBadRequest.Errorf("unknown op %q", req.Op)
	}
	n, _ := a.applied.LoadOrStore(a.id, new(int))
	*n.(*int)++
	return accountRep{Balance: a.balance}, nil
}

func accountType(key natshard.Key[accountReq, accountRep], applied *sync.Map) natshard.Type {
	t := natshard.TypeOf(key, func(_ context.Context, id string) (natshard.Handler[accountReq, accountRep], error) {
		return &account{id: id, applied: applied}, nil
	})
	t.Shards, t.MinRegions, t.RebalanceInterval = 4, 2, natshard.Off
	return t
}

// TestTypedRoundTrip: a typed type hosted by two nodes on connections of
// their own is asked by a sender of package send alone (a connection of
// its own): requests and replies are Go values, a declared error comes
// back matched by errors.Is and errors.As with its details; the same
// entity answers a raw nc.Request in JSON, and a request that does not
// decode is answered with the code bad-request.
func TestTypedRoundTrip(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	var applied sync.Map
	for _, r := range []string{"a", "b"} {
		mustStartOn(t, url, r, accountType(accountKey, &applied))
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	sender := send.NewClient(natstest.Connect(t, url))
	// The key as a program that only sends declares it: package send.
	alice := send.NewKey[accountReq, accountRep]("account").Ref(sender, "alice")

	rep, err := alice.Ask(ctx, accountReq{Op: "deposit", Amount: 10})
	if err != nil || rep.Balance != 10 {
		t.Fatalf("deposit: %+v, %v; want a balance of 10", rep, err)
	}
	_, err = alice.Ask(ctx, accountReq{Op: "withdraw", Amount: 25})
	if !errors.Is(err, errInsufficientFunds) {
		t.Fatalf("withdraw beyond the balance: %v; want errors.Is insufficient-funds", err)
	}
	var declared *natshard.Error
	if !errors.As(err, &declared) || declared.Code() != "insufficient-funds" || declared.Message() != "insufficient funds" {
		t.Fatalf("errors.As *Error: %+v", declared)
	}
	var ee *send.EntityError
	if !errors.As(err, &ee) || ee.Code != "insufficient-funds" || ee.ID != "alice" {
		t.Fatalf("errors.As *EntityError: %+v", ee)
	}
	var missing shortfall
	if !accountKey.Details(err, &missing) || missing.Missing != 15 {
		t.Fatalf("details: %+v; want 15 missing", missing)
	}
	if errors.Is(err, natshard.ErrBadRequest) {
		t.Fatal("an insufficient-funds error matches bad-request")
	}
	if err := alice.Tell(ctx, accountReq{Op: "deposit", Amount: 5}); err != nil {
		t.Fatal(err)
	}

	// The wire is plain: JSON on the entity's subject.
	nc := natstest.Connect(t, url)
	subject := protocol.MustSubjects("", "", "account").EntityOf("alice", 4)
	natstest.Eventually(t, 20*time.Second, "the tell applied", func() bool {
		m, err := nc.Request(subject, []byte(`{"op":"balance"}`), 5*time.Second)
		return err == nil && string(m.Data) == `{"balance":15}`
	})
	m, err := nc.Request(subject, []byte(`{"op":"withdraw","amount":100}`), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if got := m.Header.Get(protocol.HeaderErrorCode); got != "insufficient-funds" || string(m.Data) != `{"missing":85}` {
		t.Fatalf("raw withdraw: code %q, body %s; want insufficient-funds, {\"missing\":85}", got, m.Data)
	}
	m, err = nc.Request(subject, []byte(`not json`), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if got := m.Header.Get(protocol.HeaderErrorCode); got != "bad-request" {
		t.Fatalf("raw request that does not decode: code %q (%s: %s); want bad-request", got, m.Header.Get(protocol.HeaderError), m.Data)
	}
	_, err = natshard.NewClient(nc).Entity("account", "alice").Request(ctx, []byte(`{"op":"close"}`))
	if !errors.Is(err, natshard.ErrBadRequest) {
		t.Fatalf("unknown op: %v; want bad-request", err)
	}
}

// TestTypedAskKeyedOnce, in both delivery modes: a typed Ask with an
// idempotency key (MsgID), sent twice, is applied once and both calls get
// the same answer; an error answer kept for a key keeps its code.
func TestTypedAskKeyedOnce(t *testing.T) {
	for _, delivery := range []natshard.Delivery{natshard.Core, natshard.Durable} {
		t.Run(string(delivery), func(t *testing.T) { testTypedAskKeyedOnce(t, delivery) })
	}
}

func testTypedAskKeyedOnce(t *testing.T, delivery natshard.Delivery) {
	url := natstest.URL(natstest.RunServer(t))
	var applied sync.Map
	for _, r := range []string{"a", "b"} {
		typ := accountType(accountKey, &applied)
		typ.Delivery = delivery
		mustStartOn(t, url, r, typ)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	bob := accountKey.Ref(natshard.NewClient(natstest.Connect(t, url)), "bob")
	var reps []accountRep
	for i := range 2 {
		rep, err := bob.Ask(ctx, accountReq{Op: "deposit", Amount: 7}, natshard.MsgID("dep-1"))
		if err != nil {
			t.Fatalf("ask %d: %v", i, err)
		}
		reps = append(reps, rep)
	}
	n, _ := applied.Load("bob")
	if reps[0] != reps[1] || reps[0].Balance != 7 || n == nil || *n.(*int) != 1 {
		t.Fatalf("answers %+v, applied %v; want two balances of 7, applied once", reps, n)
	}
	var errs []error
	for range 2 {
		_, err := bob.Ask(ctx, accountReq{Op: "withdraw", Amount: 100}, natshard.MsgID("wd-1"))
		errs = append(errs, err)
	}
	for i, err := range errs {
		if !errors.Is(err, errInsufficientFunds) {
			t.Fatalf("keyed withdraw %d: %v; want insufficient-funds both times", i, err)
		}
	}
	if errs[0].Error() != errs[1].Error() {
		t.Fatalf("the answers differ: %v / %v", errs[0], errs[1])
	}
}

// TestTypedMsgpack: a key with the msgpack codec round-trips, and its
// error details too.
func TestTypedMsgpack(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	key := natshard.NewKey[accountReq, accountRep]("account", natshard.WithCodec(natshard.Msgpack))
	var applied sync.Map
	typ := accountType(key, &applied)
	typ.MinRegions = 1
	mustStartOn(t, url, "a", typ)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	carol := key.Ref(natshard.NewClient(natstest.Connect(t, url)), "carol")
	if rep, err := carol.Ask(ctx, accountReq{Op: "deposit", Amount: 3}); err != nil || rep.Balance != 3 {
		t.Fatalf("deposit: %+v, %v", rep, err)
	}
	_, err := carol.Ask(ctx, accountReq{Op: "withdraw", Amount: 5})
	var missing shortfall
	if !errors.Is(err, errInsufficientFunds) || !key.Details(err, &missing) || missing.Missing != 2 {
		t.Fatalf("withdraw: %v, details %+v", err, missing)
	}
}

// TestErrorMatching: declared errors match by code, through wrapping and
// Errorf, and not across codes.
func TestErrorMatching(t *testing.T) {
	other := natshard.NewError("other", "other")
	wrapped := fmt.Errorf("ctx: %w", errInsufficientFunds.Errorf("short by %d", 3))
	if !errors.Is(wrapped, errInsufficientFunds) || errors.Is(wrapped, other) {
		t.Fatal("Errorf's error does not match its code alone")
	}
	if got := protocol.ErrorCode(wrapped); got != "insufficient-funds" {
		t.Fatalf("code %q", got)
	}
	if got := protocol.ErrorCode(natshard.NewError("bad code\r\n", "x")); got != "" {
		t.Fatalf("an invalid code crosses the wire: %q", got)
	}
	m := protocol.ErrorReply("_INBOX.x", nil, wrapped)
	if m.Header.Get(protocol.HeaderErrorCode) != "insufficient-funds" || string(m.Data) != `{"code":"insufficient-funds","error":"ctx: short by 3","ok":false}` {
		t.Fatalf("error reply: %v %s", m.Header, m.Data)
	}
	if m := protocol.ErrorReply("_INBOX.x", nil, errors.New("plain")); m.Header.Get(protocol.HeaderErrorCode) != "" || string(m.Data) != `{"error":"plain","ok":false}` {
		t.Fatalf("a plain error's reply: %v %s", m.Header, m.Data)
	}
	ee := &send.EntityError{Code: "insufficient-funds"}
	if !errors.Is(ee, errInsufficientFunds) || errors.Is(ee, other) || errors.Is(&send.EntityError{}, natshard.NewError("", "")) {
		t.Fatal("EntityError matches by code")
	}
}

// TestTypedKeyedAcrossMove: a persistent typed entity (examples/cart,
// UpdateReply) asked with an idempotency key, then asked again with it
// after its shard moved to the other node, applies it once and answers
// both times alike.
func TestTypedKeyedAcrossMove(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	nodes := map[string]*natshard.Node{}
	for _, r := range []string{"a", "b"} {
		typ := cartex.Type()
		typ.Shards, typ.MinRegions, typ.RebalanceInterval = 4, 2, natshard.Off
		nodes[r] = mustStartOn(t, url, r, typ)
	}
	held := func(r string) []int { s, _ := nodes[r].Stats("cart"); return s.Shards }
	natstest.Eventually(t, 20*time.Second, "every shard held", func() bool { return len(held("a"))+len(held("b")) == 4 })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	alice := cartex.Key.Ref(natshard.NewClient(natstest.Connect(t, url)), "alice")
	first, err := alice.Ask(ctx, cartex.Request{Op: "add", Item: "apple"}, natshard.MsgID("add-1"))
	if err != nil {
		t.Fatal(err)
	}
	shard := protocol.ShardOf("alice", 4)
	to := "a"
	if slices.Contains(held("a"), shard) {
		to = "b"
	}
	admin := natstest.Connect(t, url)
	natstest.Eventually(t, 20*time.Second, "the shard moved to "+to, func() bool {
		if slices.Contains(held(to), shard) {
			return true
		}
		if _, err := admin.Request(protocol.MustSubjects("", "", "cart").Admin(protocol.AdminMove), fmt.Appendf(nil, `{"shard":%d,"region":%q}`, shard, to), 5*time.Second); err != nil {
			t.Fatalf("move: %v", err)
		}
		return false
	})
	again, err := alice.Ask(ctx, cartex.Request{Op: "add", Item: "apple"}, natshard.MsgID("add-1"))
	if err != nil {
		t.Fatal(err)
	}
	got, err := alice.Ask(ctx, cartex.Request{Op: "get"})
	if err != nil {
		t.Fatal(err)
	}
	if first.Items["apple"] != 1 || again.Items["apple"] != 1 || got.Items["apple"] != 1 {
		t.Fatalf("first %v, again %v, then %v; want one apple each time", first.Items, again.Items, got.Items)
	}
}

// probeRep is what the probe entity reads of the message it handles.
type probeRep struct {
	ID     string `json:"id"`
	Header string `json:"header"`
	Seq    uint64 `json:"seq"`
}

var probeKey = natshard.NewKey[struct{}, probeRep]("probe")

// TestTypedMessageContext, in both delivery modes: a HandlerFunc entity
// reads the message it handles from its context (MessageFrom): the
// headers its sender added (Header) and its stream sequence (SeqFrom:
// growing in durable delivery, 0 in core); outside a Handle both give
// nothing.
func TestTypedMessageContext(t *testing.T) {
	if natshard.MessageFrom(context.Background()) != nil || natshard.SeqFrom(context.Background()) != 0 {
		t.Fatal("MessageFrom or SeqFrom gave something outside a Handle")
	}
	for _, delivery := range []natshard.Delivery{natshard.Core, natshard.Durable} {
		t.Run(string(delivery), func(t *testing.T) {
			url := natstest.URL(natstest.RunServer(t))
			typ := natshard.TypeOf(probeKey, func(context.Context, string) (natshard.Handler[struct{}, probeRep], error) {
				return natshard.HandlerFunc[struct{}, probeRep](func(ctx context.Context, _ struct{}) (probeRep, error) {
					m := natshard.MessageFrom(ctx)
					return probeRep{ID: m.EntityID, Header: m.Header.Get("X-Probe"), Seq: natshard.SeqFrom(ctx)}, nil
				}), nil
			})
			typ.Shards, typ.Delivery = 4, delivery
			mustStartOn(t, url, "a", typ)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			ref := probeKey.Ref(natshard.NewClient(natstest.Connect(t, url)), "p1")
			if ref.ID() != "p1" || ref.Type() != "probe" {
				t.Fatalf("ref of %q of type %q; want p1 of probe", ref.ID(), ref.Type())
			}
			var reps []probeRep
			for i := range 2 {
				rep, err := ref.Ask(ctx, struct{}{}, natshard.Header(nats.Header{"X-Probe": {fmt.Sprint("ask-", i)}}))
				if err != nil {
					t.Fatalf("ask %d: %v", i, err)
				}
				reps = append(reps, rep)
			}
			for i, rep := range reps {
				if rep.ID != "p1" || rep.Header != fmt.Sprint("ask-", i) {
					t.Errorf("ask %d: the entity read %+v; want id p1, header ask-%d", i, rep, i)
				}
			}
			if delivery == natshard.Core && (reps[0].Seq != 0 || reps[1].Seq != 0) {
				t.Errorf("sequences %d, %d in core delivery; want 0", reps[0].Seq, reps[1].Seq)
			}
			if delivery == natshard.Durable && (reps[0].Seq == 0 || reps[1].Seq <= reps[0].Seq) {
				t.Errorf("sequences %d, %d in durable delivery; want growing from above 0", reps[0].Seq, reps[1].Seq)
			}
		})
	}
}
