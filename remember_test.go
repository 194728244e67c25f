package natshard_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/internal/natstest"
)

// activations records which region activated which entity, and how.
type activations struct {
	mu   sync.Mutex
	byID map[string][]string // entity -> regions that activated it, in order
}

func (a *activations) add(id, region string) {
	a.mu.Lock()
	a.byID[id] = append(a.byID[id], region)
	a.mu.Unlock()
}

func (a *activations) of(id string) []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.byID[id])
}

// passivating answers its messages and passivates itself on "bye".
type passivating struct{ env *natshard.Env }

func (p passivating) Handle(_ context.Context, m *natshard.Message) ([]byte, error) {
	if string(m.Data) == "bye" {
		p.env.Passivate()
	}
	return m.Data, nil
}
func (passivating) Stop(context.Context) error { return nil }

// TestRememberedEntities (issue 13, remembered entities): entities of a
// type with Remember are started again by their shard's new owner without
// a message, after a graceful move and after their process closed
// without handing off (as after a crash); an entity that passivated
// itself is not; a process that would remember a type made without is
// refused; Remember with an idle timeout is refused before anything
// starts.
func TestRememberedEntities(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	acts := &activations{byID: map[string][]string{}}
	typ := natshard.Type{Name: "rem", Shards: 8, Remember: true, Entity: func(ctx context.Context, id string) (natshard.Entity, error) {
		env := natshard.EnvFrom(ctx)
		acts.add(id, env.Region)
		return passivating{env: env}, nil
	}}
	a := mustStartOn(t, url, "a", typ)
	if got, _ := a.Type("rem"); !got.Remember || got.IdleTimeout != natshard.Off {
		t.Fatalf("hosted as %+v", got)
	}
	ids := entityIDs(24)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for _, id := range ids {
		if _, err := a.Client().Request(ctx, "rem", id, []byte("hi")); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := a.Client().Request(ctx, "rem", "e0", []byte("bye")); err != nil {
		t.Fatal(err)
	}
	natstest.Eventually(t, time.Minute, "e0 to passivate", func() error {
		if st, _ := a.Stats("rem"); st.Passivations != 1 || st.Entities != len(ids)-1 {
			return fmt.Errorf("%d passivations, %d entities", st.Passivations, st.Entities)
		}
		return nil
	})

	// b joins, a leaves gracefully: b starts every entity but e0.
	b := mustStartOn(t, url, "b", typ)
	sctx, scancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer scancel()
	if err := a.Stop(sctx); err != nil {
		t.Fatal(err)
	}
	rest := ids[1:]
	waitRestarted(t, b, "rem", acts, rest, "b")
	if got := acts.of("e0"); !slices.Equal(got, []string{"a"}) {
		t.Errorf("e0, passivated, was activated by %v", got)
	}

	// c joins, b closes without a handoff: c starts them all again.
	c := mustStartOn(t, url, "c", typ)
	if err := b.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	waitRestarted(t, c, "rem", acts, rest, "c")
	if got := acts.of("e0"); !slices.Equal(got, []string{"a"}) {
		t.Errorf("e0, passivated, was activated by %v", got)
	}

	// Refusals.
	mustStartOn(t, url, "d", natshard.Type{Name: "plain", Entity: newEnvEntity})
	_, err := startOn(t, url, "e", natshard.Type{Name: "plain", Remember: true, Entity: newEnvEntity})
	if !errors.Is(err, natshard.ErrConfigMismatch) {
		t.Errorf("Remember on a type made without: %v", err)
	}
	_, err = startOn(t, url, "e", natshard.Type{Name: "x", Remember: true, IdleTimeout: time.Minute, Entity: newEnvEntity})
	if err == nil || !strings.Contains(err.Error(), "IdleTimeout") || !strings.Contains(err.Error(), "with Remember") {
		t.Errorf("Remember with an idle timeout: %v", err)
	}
}

// waitRestarted waits until node n (region) activated every entity of
// ids without a message (its Restarted count says so), each once there.
func waitRestarted(t *testing.T, n *natshard.Node, typ string, acts *activations, ids []string, region string) {
	t.Helper()
	// Restarted counts a start when it is scheduled; the Factory, which
	// records the activation, runs after it on a worker.
	natstest.Eventually(t, time.Minute, "the remembered entities to start on "+region, func() error {
		st, _ := n.Stats(typ)
		if st.Restarted < uint64(len(ids)) {
			return fmt.Errorf("%d of %d restarted", st.Restarted, len(ids))
		}
		for _, id := range ids {
			if got := acts.of(id); len(got) == 0 || got[len(got)-1] != region {
				return fmt.Errorf("entity %s was activated by %v", id, got)
			}
		}
		return nil
	})
	for _, id := range ids {
		if got := acts.of(id); slices.Index(got, region) != len(got)-1 {
			t.Errorf("entity %s was activated by %v", id, got)
		}
	}
	if st, _ := n.Stats(typ); st.Restarted != uint64(len(ids)) || st.Delivered != 0 {
		t.Errorf("%s: %d restarted (want %d), %d messages delivered", region, st.Restarted, len(ids), st.Delivered)
	}
}

// reminded records the reminders its entities get.
type reminded struct {
	env *natshard.Env
	log *handledLog
}

func (r reminded) Handle(ctx context.Context, m *natshard.Message) ([]byte, error) {
	if name := m.Reminder(); name != "" {
		r.log.add(r.env.ID, name+"="+string(m.Data)+"@"+r.env.Region)
		return nil, nil
	}
	f := strings.Fields(string(m.Data)) // op name delay
	if len(f) != 3 {
		return nil, fmt.Errorf("bad command %q", m.Data)
	}
	op, name := f[0], f[1]
	after, err := time.ParseDuration(f[2])
	if err != nil {
		return nil, err
	}
	switch op {
	case "set":
		return nil, r.env.RemindAfter(ctx, name, after, []byte(fmt.Sprint(after)))
	case "cancel":
		return nil, r.env.CancelReminder(ctx, name)
	}
	return nil, fmt.Errorf("unknown op %q", op)
}
func (reminded) Stop(context.Context) error { return nil }

// TestReminders (issue 13, durable reminders): an entity's reminder comes
// to it as a message with its name, once, after its delay, on whichever
// region owns the shard by then (the shard moved meanwhile); setting a
// reminder again replaces it; a cancelled one never comes; in core
// delivery Remind says ErrNotDurable.
func TestReminders(t *testing.T) {
	url := natstest.URL(natstest.RunServer(t))
	log := &handledLog{seen: map[string][]string{}}
	factory := func(ctx context.Context, id string) (natshard.Entity, error) {
		return reminded{env: natshard.EnvFrom(ctx), log: log}, nil
	}
	typ := natshard.Type{Name: "rmd", Shards: 4, Entity: factory}
	a := durableNode(t, url, "a", typ)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	send := func(n *natshard.Node, id, cmd string) {
		t.Helper()
		if _, err := n.Client().Request(ctx, "rmd", id, []byte(cmd)); err != nil {
			t.Fatalf("%s %q: %v", id, cmd, err)
		}
	}
	ids := entityIDs(8)
	for _, id := range ids {
		send(a, id, "set ping 1h")
		send(a, id, "set ping 2s") // replaces the hour
		send(a, id, "set gone 1s")
		send(a, id, "cancel gone 0s")
	}
	// The shards move to b before the reminders are due.
	b := durableNode(t, url, "b", typ)
	sctx, scancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer scancel()
	if err := a.Stop(sctx); err != nil {
		t.Fatal(err)
	}
	waitHandled(t, log, ids, 1)
	// A last reminder, due after the others: a second ping, or the
	// cancelled one, would come before it.
	for _, id := range ids {
		send(b, id, "set mark 1s")
	}
	waitHandled(t, log, ids, 2)
	log.mu.Lock()
	for _, id := range ids {
		if got := log.seen[id]; !slices.Equal(got, []string{"ping=2s@b", "mark=1s@b"}) {
			t.Errorf("entity %s got reminders %q, want ping=2s once on b, then the mark", id, got)
		}
	}
	log.mu.Unlock()
	if st, _ := b.Stats("rmd"); st.Failed != 0 {
		t.Errorf("%d messages failed on b", st.Failed)
	}

	core := mustStartOn(t, url, "c", natshard.Type{Name: "core", Entity: factory})
	_, err := core.Client().Request(ctx, "core", "x", []byte("set ping 1s"))
	var ee *natshard.EntityError
	if !errors.As(err, &ee) || !strings.Contains(ee.Error(), natshard.ErrNotDurable.Error()) {
		t.Errorf("a reminder in core delivery: %v", err)
	}
}
