package entities

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/natshard/natshard/internal/natstest"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/region"
)

// memStore is an in-memory StateStore with compare-and-set semantics and
// injectable failures.
type memStore struct {
	mu      sync.Mutex
	entries map[string]memEntry
	seq     uint64
	saves   int
	// fail, when set, is asked before each operation ("load", "save",
	// "delete"); a non-nil error is returned instead.
	fail func(op, id string) error
}

type memEntry struct {
	data []byte
	rev  uint64
}

func newMemStore() *memStore { return &memStore{entries: map[string]memEntry{}} }

func (s *memStore) LoadEntity(_ context.Context, id string) ([]byte, uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fail != nil {
		if err := s.fail("load", id); err != nil {
			return nil, 0, err
		}
	}
	e, ok := s.entries[id]
	if !ok {
		return nil, 0, fmt.Errorf("entity %q: %w", id, kvstate.ErrNotFound)
	}
	return bytes.Clone(e.data), e.rev, nil
}

func (s *memStore) SaveEntity(_ context.Context, id string, data []byte, rev uint64) (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var lost error // errStoredAnyway: stored, then this error
	if s.fail != nil {
		if err := s.fail("save", id); errors.Is(err, errStoredAnyway) || errors.Is(err, errStoredConflict) {
			lost = err
		} else if err != nil {
			return 0, err
		}
	}
	if cur := s.entries[id]; cur.rev != rev {
		return 0, fmt.Errorf("entity %q at revision %d, not %d: %w", id, cur.rev, rev, kvstate.ErrConflict)
	}
	s.seq++
	s.saves++
	s.entries[id] = memEntry{data: bytes.Clone(data), rev: s.seq}
	if lost != nil {
		return 0, lost
	}
	return s.seq, nil
}

// errStoredAnyway, from memStore.fail, makes a save store its write and
// fail all the same: its answer was lost.
var errStoredAnyway = fmt.Errorf("timeout, the write stored all the same: %w", kvstate.ErrUnavailable)

// errStoredConflict, from memStore.fail, makes a save store its write and
// answer a conflict all the same.
var errStoredConflict = fmt.Errorf("wrong last sequence, the write stored all the same: %w", kvstate.ErrConflict)

func (s *memStore) DeleteEntity(_ context.Context, id string, rev uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fail != nil {
		if err := s.fail("delete", id); err != nil {
			return err
		}
	}
	cur, ok := s.entries[id]
	if !ok {
		return kvstate.ErrNotFound
	}
	if cur.rev != rev {
		return kvstate.ErrConflict
	}
	delete(s.entries, id)
	return nil
}

// put writes id's state as another writer would.
func (s *memStore) put(id, data string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seq++
	s.entries[id] = memEntry{data: []byte(data), rev: s.seq}
}

// get returns id's stored state ("" when absent).
func (s *memStore) get(id string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return string(s.entries[id].data)
}

func (s *memStore) saveCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.saves
}

func newKV(t testing.TB, store StateStore, id string) region.Entity {
	t.Helper()
	e, err := KV(store)(context.Background(), id)
	if err != nil {
		t.Fatalf("KV factory: %v", err)
	}
	return e
}

func call(t testing.TB, e region.Entity, request string) (string, error) {
	t.Helper()
	out, err := e.Handle(context.Background(), &region.Message{EntityID: "doc", Reply: "r", Data: []byte(request)})
	return string(out), err
}

// mustOK sends request and checks the answer is {"ok":true,"value":want}.
func mustOK(t *testing.T, e region.Entity, request, want string) {
	t.Helper()
	out, err := call(t, e, request)
	if err != nil {
		t.Fatalf("%s: error %v (answer %s)", request, err, out)
	}
	if w := `{"ok":true,"value":` + want + `}`; out != w {
		t.Fatalf("%s:\n got %s\nwant %s", request, out, w)
	}
}

// mustFail sends request and checks the answer is ok:false with an error
// matching target, whose message contains substr.
func mustFail(t *testing.T, e region.Entity, request string, target error, substr string) {
	t.Helper()
	out, err := call(t, e, request)
	if err == nil {
		t.Fatalf("%s: no error (answer %s)", request, out)
	}
	if target != nil && !errors.Is(err, target) {
		t.Fatalf("%s: error %v, want %v", request, err, target)
	}
	var a struct {
		OK    *bool   `json:"ok"`
		Error *string `json:"error"`
	}
	if jerr := json.Unmarshal([]byte(out), &a); jerr != nil || a.OK == nil || *a.OK || a.Error == nil {
		t.Fatalf("%s: answer %s is not {\"ok\":false,\"error\":...}", request, out)
	}
	if *a.Error != err.Error() {
		t.Fatalf("%s: answer error %q, returned error %q", request, *a.Error, err)
	}
	if !strings.Contains(*a.Error, substr) {
		t.Fatalf("%s: error %q does not mention %q", request, *a.Error, substr)
	}
}

func TestKVOps(t *testing.T) {
	store := newMemStore()
	e := newKV(t, store, "doc")
	steps := []struct{ req, want string }{
		{`{"op":"get"}`, `{}`},
		{`{"op":"get","key":"a"}`, `null`},
		{`{"op":"set","key":"a","value":1}`, `1`},
		{`{"op":"get","key":"a"}`, `1`},
		{`{"op":"incr","key":"a","by":41}`, `42`},
		{`{"op":"incr","key":"a"}`, `43`},
		{`{"op":"incr","key":"a","by":-50}`, `-7`},
		{`{"op":"incr","key":"n"}`, `1`},
		{`{"op":"incr","key":"m","by":5}`, `5`},
		{`{"op":"set","key":"big","value":123456789012345678901234567890}`, `123456789012345678901234567890`},
		{`{"op":"incr","key":"big","by":10}`, `123456789012345678901234567900`},
		{`{"op":"set","key":"f","value":1.50}`, `1.50`},
		{`{"op":"append","key":"l","value":"x"}`, `["x"]`},
		{`{"op":"append","key":"l","value":{"y":[1,2]}}`, `["x",{"y":[1,2]}]`},
		{`{"op":"append","key":"l","value":null}`, `["x",{"y":[1,2]},null]`},
		{`{"op":"set","key":"s","value":"ab"}`, `"ab"`},
		{`{"op":"append","key":"s","value":"c<&>"}`, `"abc<&>"`},
		{`{"op":"set","key":"o","value":{"z":1,"b":[true,false,null]}}`, `{"b":[true,false,null],"z":1}`},
		{`{"op":"set","key":"","value":"empty key"}`, `"empty key"`},
		{`{"op":"set","key":"nul","value":null}`, `null`},
		{`{"op":"delete","key":"nul"}`, `null`},
		{`{"op":"delete","key":"never"}`, `null`},
		{`{"op":"delete","key":"m"}`, `null`},
		{`{"op":"get","key":"m"}`, `null`},
		{`{"op":"get","unknown":"fields are ignored"}`, `{"":"empty key","a":-7,"big":123456789012345678901234567900,"f":1.50,"l":["x",{"y":[1,2]},null],"n":1,"o":{"b":[true,false,null],"z":1},"s":"abc<&>"}`},
	}
	for _, s := range steps {
		mustOK(t, e, s.req, s.want)
	}
	// What is stored is the document, numbers as written.
	if got, want := store.get("doc"), `{"":"empty key","a":-7,"big":123456789012345678901234567900,"f":1.50,"l":["x",{"y":[1,2]},null],"n":1,"o":{"b":[true,false,null],"z":1},"s":"abc<&>"}`; got != want {
		t.Fatalf("stored %s\nwant   %s", got, want)
	}
}

func TestKVReadsDoNotSave(t *testing.T) {
	store := newMemStore()
	e := newKV(t, store, "doc")
	mustOK(t, e, `{"op":"get"}`, `{}`)
	mustOK(t, e, `{"op":"get","key":"x"}`, `null`)
	mustOK(t, e, `{"op":"delete","key":"x"}`, `null`)
	if n := store.saveCount(); n != 0 {
		t.Fatalf("%d saves for reads", n)
	}
	if _, _, err := store.LoadEntity(context.Background(), "doc"); !errors.Is(err, kvstate.ErrNotFound) {
		t.Fatalf("state created by reads: %v", err)
	}
}

func TestKVBadRequests(t *testing.T) {
	store := newMemStore()
	e := newKV(t, store, "doc")
	mustOK(t, e, `{"op":"set","key":"s","value":"str"}`, `"str"`)
	mustOK(t, e, `{"op":"set","key":"o","value":{}}`, `{}`)
	mustOK(t, e, `{"op":"set","key":"f","value":1.5}`, `1.5`)
	mustOK(t, e, `{"op":"set","key":"nul","value":null}`, `null`)
	saves := store.saveCount()
	stored := store.get("doc")

	for _, tc := range []struct{ req, substr string }{
		{``, "malformed request"},
		{`   `, "malformed request"},
		{`{`, "malformed request"},
		{`not json`, "malformed request"},
		{`[]`, "malformed request"},
		{`"get"`, "malformed request"},
		{`null`, "missing op"},
		{`{"op":"get"} {"op":"get"}`, "data after"},
		{`{"op":"get"}x`, "data after"},
		{`{}`, "missing op"},
		{`{"op":""}`, "missing op"},
		{`{"op":1}`, "malformed request"},
		{`{"op":"explode","key":"a"}`, `unknown op "explode"`},
		{`{"op":"GET"}`, "unknown op"},
		{`{"op":"set","value":1}`, "set needs a key"},
		{`{"op":"set","key":null,"value":1}`, "set needs a key"},
		{`{"op":"set","key":1,"value":1}`, "malformed request"},
		{`{"op":"set","key":"a"}`, "set needs a value"},
		{`{"op":"incr"}`, "incr needs a key"},
		{`{"op":"incr","key":"a","by":1.5}`, "by must be an integer, not a number"},
		{`{"op":"incr","key":"a","by":1e3}`, "by must be an integer"},
		{`{"op":"incr","key":"a","by":"1"}`, "by must be an integer, not a string"},
		{`{"op":"incr","key":"a","by":null}`, "by must be an integer, not null"},
		{`{"op":"incr","key":"s"}`, `the value at "s" is a string, not an integer`},
		{`{"op":"incr","key":"f"}`, `the value at "f" is a number, not an integer`},
		{`{"op":"incr","key":"nul"}`, "is null"},
		{`{"op":"append","key":"a"}`, "append needs a value"},
		{`{"op":"append","value":1}`, "append needs a key"},
		{`{"op":"append","key":"s","value":1}`, `cannot append an integer to the string at "s"`},
		{`{"op":"append","key":"o","value":1}`, `the value at "o" is an object`},
		{`{"op":"append","key":"f","value":1}`, `the value at "f" is a number`},
		{`{"op":"append","key":"nul","value":1}`, `the value at "nul" is null`},
		{`{"op":"delete"}`, "delete needs a key"},
	} {
		mustFail(t, e, tc.req, ErrBadRequest, tc.substr)
	}
	if store.saveCount() != saves || store.get("doc") != stored {
		t.Fatalf("bad requests changed the stored state: %s", store.get("doc"))
	}
	mustOK(t, e, `{"op":"get"}`, stored)
}

func TestKVPublishApplied(t *testing.T) {
	store := newMemStore()
	e := newKV(t, store, "doc")
	out, err := e.Handle(context.Background(), &region.Message{EntityID: "doc", Data: []byte(`{"op":"incr","key":"n"}`)})
	if err != nil || string(out) != `{"ok":true,"value":1}` {
		t.Fatalf("publish: %s, %v", out, err)
	}
	if got := store.get("doc"); got != `{"n":1}` {
		t.Fatalf("stored %s", got)
	}
}

func TestKVPersistedBeforeAnswer(t *testing.T) {
	store := newMemStore()
	e := newKV(t, store, "doc")
	for i, req := range []string{
		`{"op":"set","key":"a","value":"x"}`,
		`{"op":"append","key":"a","value":"y"}`,
		`{"op":"incr","key":"n","by":3}`,
		`{"op":"delete","key":"a"}`,
	} {
		if _, err := call(t, e, req); err != nil {
			t.Fatal(err)
		}
		if n := store.saveCount(); n != i+1 {
			t.Fatalf("after %s: %d saves, want %d", req, n, i+1)
		}
		// A new incarnation (crash right after the answer) sees the change.
		fresh := newKV(t, store, "doc")
		a, _ := call(t, e, `{"op":"get"}`)
		b, _ := call(t, fresh, `{"op":"get"}`)
		if a != b {
			t.Fatalf("after %s: memory %s, store %s", req, a, b)
		}
	}
}

func TestKVSaveFailureLeavesStateUnchanged(t *testing.T) {
	store := newMemStore()
	e := newKV(t, store, "doc")
	e.(*kvEntity).retryFor = 0 // fail at once
	mustOK(t, e, `{"op":"set","key":"a","value":[1]}`, `[1]`)
	errDown := fmt.Errorf("nats down: %w", kvstate.ErrUnavailable)
	store.fail = func(op, _ string) error {
		if op == "save" {
			return errDown
		}
		return nil
	}
	mustFail(t, e, `{"op":"append","key":"a","value":2}`, kvstate.ErrUnavailable, "save state: nats down")
	mustFail(t, e, `{"op":"set","key":"b","value":1}`, kvstate.ErrUnavailable, "save state")
	mustFail(t, e, `{"op":"delete","key":"a"}`, kvstate.ErrUnavailable, "save state")
	mustOK(t, e, `{"op":"get"}`, `{"a":[1]}`)
	store.fail = nil
	mustOK(t, e, `{"op":"append","key":"a","value":2}`, `[1,2]`)
	if got := store.get("doc"); got != `{"a":[1,2]}` {
		t.Fatalf("stored %s", got)
	}
}

// TestKVSaveTriedAgain: in core delivery a save that JetStream did not
// answer is tried again (the message exists nowhere else), and never
// applied twice: a save stored whose answer was lost is found by reading
// the state back.
func TestKVSaveTriedAgain(t *testing.T) {
	errDown := fmt.Errorf("no response from stream: %w", kvstate.ErrUnavailable)
	// failing makes the next n operations op fail; with stored, a failing
	// save is stored all the same (its answer lost).
	failing := func(store *memStore, n int, op string, stored bool) {
		store.fail = func(o, _ string) error {
			if o != op || n == 0 {
				return nil
			}
			n--
			if stored {
				return errStoredAnyway
			}
			return errDown
		}
	}
	for _, tc := range []struct {
		name   string
		op     string
		n      int
		stored bool
	}{
		{"not stored", "save", 3, false},
		{"stored, answer lost", "save", 1, true},
		{"stored, answer lost, then unreadable", "save", 1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			store := newMemStore()
			e := newKV(t, store, "doc")
			mustOK(t, e, `{"op":"append","key":"v","value":1}`, `[1]`)
			saves := store.saveCount()
			failing(store, tc.n, tc.op, tc.stored)
			if tc.name == "stored, answer lost, then unreadable" {
				inner := store.fail
				loads := 2
				store.fail = func(o, id string) error {
					if o == "load" && loads > 0 {
						loads--
						return errDown
					}
					return inner(o, id)
				}
			}
			mustOK(t, e, `{"op":"append","key":"v","value":2}`, `[1,2]`)
			if got := store.get("doc"); got != `{"v":[1,2]}` {
				t.Fatalf("stored %s, want the value appended once", got)
			}
			if got := store.saveCount() - saves; got != 1 {
				t.Fatalf("%d writes stored, want 1", got)
			}
			store.fail = nil
			mustOK(t, e, `{"op":"append","key":"v","value":3}`, `[1,2,3]`)
		})
	}

	// The chaos test saw this (a value appended twice): the first save
	// was in flight, not yet stored, when the entity read the state back;
	// it landed just before the entity saved again, whose check then
	// failed. That conflict is the entity's own write, not another's.
	t.Run("stored late, after the read back", func(t *testing.T) {
		store := newMemStore()
		e := newKV(t, store, "doc")
		mustOK(t, e, `{"op":"append","key":"v","value":1}`, `[1]`)
		saves := 0
		store.fail = func(op, id string) error {
			if op != "save" {
				return nil
			}
			saves++
			switch saves {
			case 1:
				return errDown // in flight: not stored yet
			case 2: // the first lands now, before this one is checked
				store.seq++
				store.saves++
				store.entries[id] = memEntry{data: []byte(`{"v":[1,2]}`), rev: store.seq}
			}
			return nil
		}
		mustOK(t, e, `{"op":"append","key":"v","value":2}`, `[1,2]`)
		if got := store.get("doc"); got != `{"v":[1,2]}` {
			t.Fatalf("stored %s, want the value appended once", got)
		}
		store.fail = nil
		mustOK(t, e, `{"op":"append","key":"v","value":3}`, `[1,2,3]`)
	})

	t.Run("changed by another while unanswered", func(t *testing.T) {
		store := newMemStore()
		e := newKV(t, store, "doc")
		mustOK(t, e, `{"op":"incr","key":"n"}`, `1`)
		store.fail = func(op, _ string) error {
			if op == "save" {
				store.fail = nil
				store.seq++
				store.entries["doc"] = memEntry{data: []byte(`{"n":10}`), rev: store.seq}
				return errDown
			}
			return nil
		}
		mustOK(t, e, `{"op":"incr","key":"n"}`, `11`)
	})

	t.Run("no space is answered at once", func(t *testing.T) {
		store := newMemStore()
		e := newKV(t, store, "doc")
		e.(*kvEntity).retryFor = 300 * time.Millisecond
		tries := 0
		store.fail = func(op, _ string) error {
			if op == "save" {
				tries++
				return fmt.Errorf("%w: stream at its max bytes", kvstate.ErrNoSpace)
			}
			return nil
		}
		mustFail(t, e, `{"op":"set","key":"a","value":1}`, kvstate.ErrNoSpace, "max bytes")
		if tries != 1 {
			t.Fatalf("the save was tried %d times, want once", tries)
		}
	})

	t.Run("bounded", func(t *testing.T) {
		store := newMemStore()
		e := newKV(t, store, "doc")
		e.(*kvEntity).retryFor = 300 * time.Millisecond
		store.fail = func(op, _ string) error { return errDown }
		mustFail(t, e, `{"op":"set","key":"a","value":1}`, kvstate.ErrUnavailable, "no response from stream")
	})

	// The state's load at activation is tried again too: the request
	// waits for the election instead of failing.
	t.Run("load at activation", func(t *testing.T) {
		store := newMemStore()
		store.put("doc", `{"v":[1]}`)
		loads := 0
		store.fail = func(op, _ string) error {
			if op == "load" {
				if loads++; loads <= 3 {
					return errDown
				}
			}
			return nil
		}
		e := newKV(t, store, "doc")
		if loads != 4 {
			t.Fatalf("%d loads, want 3 unanswered and one more", loads)
		}
		mustOK(t, e, `{"op":"append","key":"v","value":2}`, `[1,2]`)
	})

}

func TestKVConflictReloadAndRetry(t *testing.T) {
	store := newMemStore()
	e := newKV(t, store, "doc")
	mustOK(t, e, `{"op":"set","key":"n","value":1}`, `1`)
	// Another writer (a previous owner) changed the state meanwhile.
	store.put("doc", `{"n":10,"other":"theirs"}`)
	mustOK(t, e, `{"op":"incr","key":"n"}`, `11`)
	mustOK(t, e, `{"op":"get"}`, `{"n":11,"other":"theirs"}`)
	if got := store.get("doc"); got != `{"n":11,"other":"theirs"}` {
		t.Fatalf("stored %s", got)
	}

	// The retry sees the reloaded state: an op valid before may fail now.
	store.put("doc", `{"n":"text"}`)
	mustFail(t, e, `{"op":"incr","key":"n"}`, ErrBadRequest, "not an integer")
	mustOK(t, e, `{"op":"get"}`, `{"n":"text"}`)

	// The state was deleted by someone else: the reload finds none.
	store.mu.Lock()
	delete(store.entries, "doc")
	store.mu.Unlock()
	mustOK(t, e, `{"op":"set","key":"x","value":true}`, `true`)
	if got := store.get("doc"); got != `{"x":true}` {
		t.Fatalf("stored %s", got)
	}
}

// TestKVConflictButStored: a save stored though answered with a conflict
// (the chaos test saw one while the bucket's leader changed) is not applied
// a second time: the state read back is what the save wrote.
func TestKVConflictButStored(t *testing.T) {
	store := newMemStore()
	e := newKV(t, store, "doc")
	mustOK(t, e, `{"op":"append","key":"v","value":1}`, `[1]`)
	first := true
	store.fail = func(op, _ string) error {
		if op == "save" && first {
			first = false
			return errStoredConflict
		}
		return nil
	}
	mustOK(t, e, `{"op":"append","key":"v","value":2}`, `[1,2]`)
	mustOK(t, e, `{"op":"append","key":"v","value":3}`, `[1,2,3]`)
	if got := store.get("doc"); got != `{"v":[1,2,3]}` {
		t.Fatalf("stored %s, want each value once", got)
	}
}

func TestKVConflictTwice(t *testing.T) {
	store := newMemStore()
	e := newKV(t, store, "doc")
	mustOK(t, e, `{"op":"set","key":"n","value":1}`, `1`)
	saves := 0
	store.fail = func(op, _ string) error {
		if op == "save" {
			saves++
			return kvstate.ErrConflict
		}
		return nil
	}
	mustFail(t, e, `{"op":"incr","key":"n"}`, kvstate.ErrConflict, "save state")
	if saves != 2 {
		t.Fatalf("%d save attempts, want 2 (one retry)", saves)
	}
	e.(*kvEntity).retryFor = 200 * time.Millisecond // the reload below is tried again this long
	// A reload failure after a conflict is reported too.
	store.fail = func(op, _ string) error {
		switch op {
		case "save":
			return kvstate.ErrConflict
		case "load":
			return kvstate.ErrUnavailable
		}
		return nil
	}
	mustFail(t, e, `{"op":"incr","key":"n"}`, kvstate.ErrUnavailable, "reload")
	store.fail = nil
	mustOK(t, e, `{"op":"get"}`, `{"n":1}`)
}

func TestKVStateSurvivesRecreation(t *testing.T) {
	store := newMemStore()
	factory := KV(store)
	e1, err := factory(context.Background(), "doc")
	if err != nil {
		t.Fatal(err)
	}
	mustOK(t, e1, `{"op":"set","key":"a","value":{"deep":[1,2,3]}}`, `{"deep":[1,2,3]}`)
	mustOK(t, e1, `{"op":"incr","key":"c","by":99999999999999999999}`, `99999999999999999999`)
	saves := store.saveCount()
	if err := e1.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if store.saveCount() != saves {
		t.Fatal("Stop saved")
	}
	// Passivated, handed off or restarted: a new incarnation reloads.
	e2, err := factory(context.Background(), "doc")
	if err != nil {
		t.Fatal(err)
	}
	mustOK(t, e2, `{"op":"incr","key":"c"}`, `100000000000000000000`)
	mustOK(t, e2, `{"op":"get","key":"a"}`, `{"deep":[1,2,3]}`)
	// Other ids are other documents.
	e3, err := factory(context.Background(), "other")
	if err != nil {
		t.Fatal(err)
	}
	mustOK(t, e3, `{"op":"get"}`, `{}`)
}

func TestKVDeleteLastKeyKeepsDocument(t *testing.T) {
	store := newMemStore()
	e := newKV(t, store, "doc")
	mustOK(t, e, `{"op":"set","key":"a","value":1}`, `1`)
	mustOK(t, e, `{"op":"delete","key":"a"}`, `null`)
	if got := store.get("doc"); got != `{}` {
		t.Fatalf("stored %q, want {}", got)
	}
	mustOK(t, newKV(t, store, "doc"), `{"op":"get"}`, `{}`)
}

func TestKVFactoryErrors(t *testing.T) {
	store := newMemStore()
	store.fail = func(op, _ string) error {
		if op == "load" {
			return kvstate.ErrUnavailable
		}
		return nil
	}
	// Tried again until the activation's context ends (or SaveRetryFor).
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if _, err := KV(store)(ctx, "doc"); !errors.Is(err, kvstate.ErrUnavailable) {
		t.Fatalf("factory with a failing store: %v", err)
	}
	store.fail = nil
	for _, bad := range []string{`[1]`, `null`, `not json`, `{"a":1} {}`, `"x"`} {
		store.put("doc", bad)
		if _, err := KV(store)(context.Background(), "doc"); !errors.Is(err, kvstate.ErrMalformed) {
			t.Fatalf("factory on stored %s: %v, want ErrMalformed", bad, err)
		}
	}
}

func TestKVSizeLimit(t *testing.T) {
	store := newMemStore()
	e := newKV(t, store, "doc")
	// {"a":"<v>"} is len(v)+8 bytes.
	fits := strings.Repeat("x", MaxDocumentSize-8)
	mustOK(t, e, `{"op":"set","key":"a","value":"`+fits+`"}`, `"`+fits+`"`)
	if n := len(store.get("doc")); n != MaxDocumentSize {
		t.Fatalf("stored %d bytes, want exactly %d", n, MaxDocumentSize)
	}
	mustFail(t, e, `{"op":"append","key":"a","value":"y"}`, ErrDocumentTooLarge, "document too large")
	mustFail(t, e, `{"op":"set","key":"b","value":0}`, ErrDocumentTooLarge, fmt.Sprintf("at most %d", MaxDocumentSize))
	if n := len(store.get("doc")); n != MaxDocumentSize {
		t.Fatalf("stored %d bytes after refused changes", n)
	}
	// Shrinking is always allowed.
	mustOK(t, e, `{"op":"set","key":"a","value":"small"}`, `"small"`)
	mustOK(t, e, `{"op":"append","key":"a","value":"er"}`, `"smaller"`)
}

// TestKVSizeLimitFitsNATS: a document of MaxDocumentSize bytes is saved
// in a real KV bucket and its whole-document answer fits the server's
// default max_payload (1 MiB): the limit leaves room for the KV write's
// headers and the answer's wrapper.
// openStore opens the state of type "kv" on a server of its own.
func openStore(t *testing.T) *kvstate.Store {
	t.Helper()
	nc := natstest.Connect(t, natstest.URL(natstest.RunServer(t)))
	store, err := kvstate.Open(context.Background(), natstest.JetStream(t, nc), "kv", kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return store
}

func TestKVSizeLimitFitsNATS(t *testing.T) {
	nc := natstest.Connect(t, natstest.URL(natstest.RunServer(t)))
	store, err := kvstate.Open(context.Background(), natstest.JetStream(t, nc), "kv", kvstate.Options{})
	if err != nil {
		t.Fatal(err)
	}
	e := newKV(t, store, "doc")
	fits := strings.Repeat("x", MaxDocumentSize-8)
	mustOK(t, e, `{"op":"set","key":"a","value":"`+fits+`"}`, `"`+fits+`"`)
	out, err := call(t, newKV(t, store, "doc"), `{"op":"get"}`)
	if err != nil {
		t.Fatal(err)
	}
	if int64(len(out)) > nc.MaxPayload() {
		t.Fatalf("the answer of a whole document of %d bytes is %d bytes, more than max_payload %d", MaxDocumentSize, len(out), nc.MaxPayload())
	}
}

func TestEcho(t *testing.T) {
	f := Echo()
	e1, err := f(context.Background(), "a")
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range [][]byte{nil, []byte("hello"), []byte{0, 1, 2, 0xff}} {
		out, err := e1.Handle(context.Background(), &region.Message{EntityID: "a", Data: in})
		if err != nil || !bytes.Equal(out, in) {
			t.Fatalf("echo %q = %q, %v", in, out, err)
		}
	}
	if err := e1.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// FuzzKVRequest feeds arbitrary requests to a kv entity holding a document
// with values of every type: it must never panic, always answer a JSON
// object with a boolean "ok" (and an "error" string with a returned error
// when false), and keep the stored state equal to its memory.
func FuzzKVRequest(f *testing.F) {
	for _, s := range []string{
		`{"op":"get"}`,
		`{"op":"incr","key":"n","by":-3}`,
		`{"op":"append","key":"s","value":"z"}`,
		`{"op":"set","key":"o","value":{"a":[1,{"b":null}]}}`,
		`{"op":"delete","key":"l"}`,
		`{"op":"incr","key":"f"}`,
		`[{"op":"get"}]`,
		"{\"op\":\"set\",\"key\":\"\xff\",\"value\":\"\\ud800\"}",
	} {
		f.Add([]byte(s))
	}
	const initial = `{"n":7,"big":123456789012345678901234567890,"f":1.5,"s":"str","l":[1,"two"],"o":{},"t":true,"z":null}`
	f.Fuzz(func(t *testing.T, data []byte) {
		store := newMemStore()
		store.put("doc", initial)
		e := newKV(t, store, "doc")
		out, err := e.Handle(context.Background(), &region.Message{EntityID: "doc", Reply: "r", Data: data})
		var a map[string]any
		dec := json.NewDecoder(bytes.NewReader(out))
		dec.UseNumber() // values may be integers of any size
		if jerr := dec.Decode(&a); jerr != nil || !json.Valid(out) {
			t.Fatalf("answer %q is not a JSON object: %v", out, jerr)
		}
		ok, isBool := a["ok"].(bool)
		if !isBool {
			t.Fatalf("answer %s has no boolean ok", out)
		}
		if ok != (err == nil) {
			t.Fatalf("answer %s with error %v", out, err)
		}
		if !ok {
			if msg, _ := a["error"].(string); msg == "" {
				t.Fatalf("answer %s has no error message", out)
			}
		}
		mem, _ := call(t, e, `{"op":"get"}`)
		stored, _ := call(t, newKV(t, store, "doc"), `{"op":"get"}`)
		if mem != stored {
			t.Fatalf("memory %s, store %s", mem, stored)
		}
	})
}

// callKeyed is call with the idempotency key key.
func callKeyed(t testing.TB, e region.Entity, key, request string) (string, error) {
	t.Helper()
	out, err := e.Handle(context.Background(), &region.Message{EntityID: "doc", Reply: "r", Data: []byte(request), Header: map[string][]string{"Nats-Msg-Id": {key}}})
	return string(out), err
}

// TestKVKeepsAnswers: a kv entity saves the answers to its last keyed
// changes with its document (KeptAnswers, KeptAnswerBytes): its next
// incarnation (a move, a crash) answers a message sent again with one of
// those keys as the first time, without applying it; an answer too
// large to keep is kept as an error saying it was applied; a document
// of the largest size still saves with a full window of answers.
// TestKVKeepsKeysOfLargeAnswers (campaign core seed 14): a kv entity
// whose answers are large (an append answers the whole list) still knows
// the keys of its last KeptAnswers changes when their answers no longer
// fit KeptAnswerBytes: a region killed while it replayed a shard's buffer
// had applied an entity's keyed appends 117 to 123; the next owner replayed
// them again, and the window of four answers of 470 bytes had kept only
// 120 to 123, so 117 to 119 were applied twice.
func TestKVKeepsKeysOfLargeAnswers(t *testing.T) {
	store := openStore(t)
	e := newKV(t, store, "doc")
	long := strings.Repeat("v", 200)
	const n = 8 // answers of 230 to 1 650 bytes: one or two fit KeptAnswerBytes
	for i := range n {
		if _, err := callKeyed(t, e, fmt.Sprint("append-", i), `{"op":"append","key":"l","value":"`+long+`"}`); err != nil {
			t.Fatal(err)
		}
	}
	next := newKV(t, store, "doc") // the next owner's incarnation
	for i := range n {
		key := fmt.Sprint("append-", i)
		ans, ok := next.(region.AnswerKeeper).Answer(key)
		if !ok {
			t.Fatalf("the next incarnation forgot %s: it would apply it again", key)
		}
		if i == n-1 && ans.Error != "" {
			t.Fatalf("the last answer not kept whole: %+v", ans)
		}
		out, err := callKeyed(t, next, key, `{"op":"append","key":"l","value":"`+long+`"}`)
		if i < n-1 && (err == nil || !strings.Contains(out+err.Error(), "applied once already")) {
			t.Fatalf("%s given again: %.60s, %v; want an error saying it was applied", key, out, err)
		}
	}
	out, err := call(t, next, `{"op":"get","key":"l"}`)
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Count(out, long); got != n {
		t.Fatalf("the list holds %d values after %d keyed appends each given twice; want %d", got, n, n)
	}
}

func TestKVKeepsAnswers(t *testing.T) {
	store := openStore(t)
	e := newKV(t, store, "doc")
	first, err := callKeyed(t, e, "op-1", `{"op":"incr","key":"n"}`)
	if err != nil || first != `{"ok":true,"value":1}` {
		t.Fatalf("%s, %v", first, err)
	}
	e2 := newKV(t, store, "doc")
	if ans, ok := e2.(region.AnswerKeeper).Answer("op-1"); !ok || string(ans.Data) != first || ans.Error != "" {
		t.Fatalf("the next incarnation's answer of op-1: %+v, %v", ans, ok)
	}
	if again, err := callKeyed(t, e2, "op-1", `{"op":"incr","key":"n"}`); err != nil || again != first {
		t.Fatalf("op-1 given to Handle again: %s, %v; want %s", again, err, first)
	}
	mustOK(t, e2, `{"op":"get","key":"n"}`, `1`)

	big := strings.Repeat("x", KeptAnswerBytes)
	if out, err := callKeyed(t, e2, "op-2", `{"op":"set","key":"big","value":"`+big+`"}`); err != nil || !strings.Contains(out, big) {
		t.Fatalf("a large set: %.40s, %v", out, err)
	}
	if ans, ok := newKV(t, store, "doc").(region.AnswerKeeper).Answer("op-2"); !ok || !strings.Contains(ans.Error, "applied once already") {
		t.Fatalf("an answer too large to keep: %+v, %v", ans, ok)
	}

	// The window full, then a document of the largest size.
	for i := range KeptAnswers {
		if _, err := callKeyed(t, e2, fmt.Sprint("fill-", i), `{"op":"incr","key":"n"}`); err != nil {
			t.Fatal(err)
		}
	}
	fits := strings.Repeat("x", MaxDocumentSize-len(`{"big":"","n":34}`))
	if _, err := callKeyed(t, e2, "op-3", `{"op":"set","key":"big","value":"`+fits+`"}`); err != nil {
		t.Fatalf("the largest document with a full window of answers: %v", err)
	}
	e3 := newKV(t, store, "doc").(region.AnswerKeeper)
	if _, ok := e3.Answer("op-1"); ok {
		t.Error("op-1 kept beyond the window")
	}
	if ans, ok := e3.Answer(fmt.Sprint("fill-", KeptAnswers-1)); !ok || ans.Error != "" {
		t.Errorf("the last fill: %+v, %v", ans, ok)
	}
}
