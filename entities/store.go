package entities

import (
	"context"

	"github.com/natshard/natshard/kvstate"
)

// StateStore persists entity states with compare-and-set on a revision. It
// is satisfied by *kvstate.Store. Errors: kvstate.ErrNotFound when an entity
// has no state, kvstate.ErrConflict when the revision is not the current one
// (tested with errors.Is).
type StateStore interface {
	// LoadEntity returns the state of id and its revision.
	LoadEntity(ctx context.Context, id string) ([]byte, uint64, error)
	// SaveEntity writes the state of id if its revision is still rev (0:
	// id has no state yet) and returns the new revision.
	SaveEntity(ctx context.Context, id string, data []byte, rev uint64) (uint64, error)
	// DeleteEntity deletes the state of id if its revision is still rev.
	DeleteEntity(ctx context.Context, id string, rev uint64) error
}

var _ StateStore = (*kvstate.Store)(nil)
