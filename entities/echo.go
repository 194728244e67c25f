package entities

import (
	"context"

	"github.com/natshard/natshard/region"
)

// Echo returns the factory of echo entities: each answers a request with its
// payload as is. They hold no state; all ids share one zero-size value.
func Echo() region.Factory {
	return func(context.Context, string) (region.Entity, error) { return echoEntity{}, nil }
}

type echoEntity struct{}

func (echoEntity) Handle(_ context.Context, m *region.Message) ([]byte, error) { return m.Data, nil }

func (echoEntity) Stop(context.Context) error { return nil }
