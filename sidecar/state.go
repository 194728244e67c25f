package sidecar

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/kvstate"
	"github.com/natshard/natshard/protocol"
)

// stateHandler serves the state API: an entity's persisted state (the
// type's StateStore: bytes with a revision), read with GET and written
// with PUT and DELETE, compare-and-set on the revision (ETag, If-Match).
// See docs/SIDECAR.md.
func (a *App) stateHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /state/{type}/{id}", a.getState)
	mux.HandleFunc("PUT /state/{type}/{id}", a.putState)
	mux.HandleFunc("DELETE /state/{type}/{id}", a.deleteState)
	return mux
}

// GET: 200 with the state and its ETag, 404 (ETag "0") when it has none.
func (a *App) getState(w http.ResponseWriter, r *http.Request) {
	store, id, ctx, cancel := a.stateRequest(w, r)
	if store == nil {
		return
	}
	defer cancel()
	var (
		data     []byte
		rev, seq uint64
		err      error
	)
	if ss, ok := store.(natshard.SeqStore); ok {
		data, rev, seq, err = ss.LoadEntitySeq(ctx, id)
	} else {
		data, rev, err = store.LoadEntity(ctx, id)
	}
	if errors.Is(err, natshard.ErrNotFound) {
		w.Header().Set("ETag", etag(0))
		stateError(w, http.StatusNotFound, fmt.Sprintf("entity %q has no state", id))
		return
	}
	if err != nil {
		a.storeError(w, err)
		return
	}
	w.Header().Set("ETag", etag(rev))
	if seq != 0 {
		w.Header().Set(HeaderSeq, strconv.FormatUint(seq, 10))
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Length", strconv.Itoa(len(data)))
	_, _ = w.Write(data)
}

// PUT: writes the body if the state is still at the revision of If-Match
// ("0", or If-None-Match: *, for none); 204 with the new ETag, 412 when
// another write came first.
func (a *App) putState(w http.ResponseWriter, r *http.Request) {
	rev, ok := precondition(w, r)
	if !ok {
		return
	}
	store, id, ctx, cancel := a.stateRequest(w, r)
	if store == nil {
		return
	}
	defer cancel()
	limit := a.maxAnswer.Load()
	data, err := io.ReadAll(io.LimitReader(r.Body, limit+1))
	switch {
	case err != nil:
		stateError(w, http.StatusBadRequest, fmt.Sprintf("reading the state: %v", err))
		return
	case int64(len(data)) > limit:
		stateError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("a state holds at most %d bytes here", limit))
		return
	}
	var seq uint64
	if v := r.Header.Get(HeaderSeq); v != "" {
		if seq, err = strconv.ParseUint(v, 10, 64); err != nil {
			stateError(w, http.StatusBadRequest, fmt.Sprintf("%s %q is not a sequence number", HeaderSeq, v))
			return
		}
	}
	if ss, ok := store.(natshard.SeqStore); ok && seq != 0 {
		rev, err = ss.SaveEntitySeq(ctx, id, data, rev, seq)
	} else {
		rev, err = store.SaveEntity(ctx, id, data, rev)
	}
	if err != nil {
		a.storeError(w, err)
		return
	}
	if seq != 0 {
		a.mu.Lock()
		e := a.active[r.PathValue("type")+" "+id]
		a.mu.Unlock()
		if e != nil {
			for cur := e.applied.Load(); seq > cur && !e.applied.CompareAndSwap(cur, seq); cur = e.applied.Load() {
			}
		}
	}
	w.Header().Set("ETag", etag(rev))
	w.WriteHeader(http.StatusNoContent)
}

// DELETE: deletes the state if it is still at the revision of If-Match;
// 204, or 412 when another write came first.
func (a *App) deleteState(w http.ResponseWriter, r *http.Request) {
	rev, ok := precondition(w, r)
	if !ok {
		return
	}
	store, id, ctx, cancel := a.stateRequest(w, r)
	if store == nil {
		return
	}
	defer cancel()
	if err := store.DeleteEntity(ctx, id, rev); err != nil {
		a.storeError(w, err)
		return
	}
	w.Header().Set("ETag", etag(0))
	w.WriteHeader(http.StatusNoContent)
}

// stateRequest checks the type and id of a state request and returns the
// type's store and a context bounded by the timeout; a nil store when it
// answered the request with an error.
func (a *App) stateRequest(w http.ResponseWriter, r *http.Request) (natshard.StateStore, string, context.Context, context.CancelFunc) {
	typ, id := r.PathValue("type"), r.PathValue("id")
	a.mu.Lock()
	served := a.types[typ]
	a.mu.Unlock()
	if !served {
		stateError(w, http.StatusNotFound, fmt.Sprintf("type %q is not one of this sidecar's", typ))
		return nil, "", nil, nil
	}
	if err := protocol.ValidateEntityID(id); err != nil {
		stateError(w, http.StatusBadRequest, err.Error())
		return nil, "", nil, nil
	}
	ctx, cancel := context.WithTimeout(r.Context(), a.cfg.Timeout)
	// Activations may come before Run attached the node (between the
	// region's registration and Start's return): they wait for it.
	select {
	case <-a.attached:
	case <-ctx.Done():
		cancel()
		stateError(w, http.StatusServiceUnavailable, "the node is not started yet")
		return nil, "", nil, nil
	}
	store, ok := a.node.StateStore(typ)
	if !ok {
		cancel()
		stateError(w, http.StatusNotFound, fmt.Sprintf("type %q is not hosted by this node", typ))
		return nil, "", nil, nil
	}
	return store, id, ctx, cancel
}

// precondition reads the revision a write is conditional on: If-Match
// "<revision>", or If-None-Match: * (no state: revision 0). A write
// without either is refused (428): every write is a compare-and-set.
func precondition(w http.ResponseWriter, r *http.Request) (uint64, bool) {
	match, noneMatch := r.Header.Get("If-Match"), r.Header.Get("If-None-Match")
	switch {
	case match != "" && noneMatch != "":
		stateError(w, http.StatusBadRequest, "give If-Match or If-None-Match, not both")
	case noneMatch == "*":
		return 0, true
	case noneMatch != "":
		stateError(w, http.StatusBadRequest, `If-None-Match: only * (the entity has no state) is understood`)
	case match == "":
		stateError(w, http.StatusPreconditionRequired, `every write is a compare-and-set: give If-Match with the ETag the state was read with ("0" when it has none), or If-None-Match: *`)
	default:
		rev, err := strconv.ParseUint(strings.Trim(strings.TrimPrefix(strings.TrimSpace(match), "W/"), `"`), 10, 64)
		if err != nil {
			stateError(w, http.StatusBadRequest, fmt.Sprintf("If-Match: %q is not an ETag of this API (a revision in quotes, like \"42\")", match))
			return 0, false
		}
		return rev, true
	}
	return 0, false
}

// storeError answers a store's error: 412 for a conflict, 404 for no
// state, 507 when JetStream refused the write for lack of space (the
// bucket at its limit, the store full), 503 when JetStream is unavailable
// (try again), 500 otherwise.
func (a *App) storeError(w http.ResponseWriter, err error) {
	switch {
	case errors.Is(err, natshard.ErrConflict):
		stateError(w, http.StatusPreconditionFailed, "the state is not at the If-Match revision: another write came first; read it again")
	case errors.Is(err, natshard.ErrNotFound):
		w.Header().Set("ETag", etag(0))
		stateError(w, http.StatusNotFound, err.Error())
	case errors.Is(err, kvstate.ErrNoSpace):
		stateError(w, http.StatusInsufficientStorage, err.Error())
	case errors.Is(err, kvstate.ErrUnavailable), errors.Is(err, context.DeadlineExceeded):
		stateError(w, http.StatusServiceUnavailable, err.Error())
	default:
		a.log.Warn("sidecar: state API", "err", err)
		stateError(w, http.StatusInternalServerError, err.Error())
	}
}

func etag(rev uint64) string { return `"` + strconv.FormatUint(rev, 10) + `"` }

// stateError answers {"error": msg} with status code.
func stateError(w http.ResponseWriter, code int, msg string) {
	body, _ := json.Marshal(map[string]string{"error": msg})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_, _ = w.Write(append(body, '\n'))
}
