package entities

import (
	"context"
	"fmt"
	"strings"

	"github.com/natshard/natshard"
	"github.com/natshard/natshard/region"
)

// Kinds are the names of the built-in kinds, as shardd's --kind takes them.
var Kinds = []string{"kv", "echo", "trace"}

// Kind returns the factory of the built-in kind name, for a type hosted by
// a natshard node: kv entities store their documents in their type's
// bucket, trace entities publish their records on traceSubject (default
// natshard.trace.<type>) through the node's connection.
func Kind(name, traceSubject string) (natshard.Factory, error) {
	switch name {
	case "kv":
		return KV(nil), nil
	case "echo":
		return Echo(), nil
	case "trace":
		return func(ctx context.Context, id string) (region.Entity, error) {
			env := natshard.EnvFrom(ctx)
			if env == nil {
				return nil, fmt.Errorf("entities: a trace entity outside a natshard node")
			}
			subject := traceSubject
			if subject == "" {
				subject = "natshard.trace." + env.Type
			}
			return Trace(env.Conn.Publish, subject, env.Region)(ctx, id)
		}, nil
	}
	return nil, fmt.Errorf("entities: %q is not a built-in kind (%s)", name, strings.Join(Kinds, ", "))
}
