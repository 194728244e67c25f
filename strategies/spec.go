package strategies

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
)

// ErrBadSpec: a strategy spec that does not parse.
var ErrBadSpec = errors.New("strategies: bad strategy spec")

// DefaultSpec is the canonical spec of the default strategy.
const DefaultSpec = "least-shard:absolute=65536,relative=1"

// param is one parameter of a named strategy, with its default.
type param struct {
	name string
	def  float64
	int  bool // a whole number
}

var specs = map[string][]param{
	"least-shard":        {{"absolute", DefaultAbsoluteLimit, true}, {"relative", DefaultRelativeLimit, false}},
	"legacy-least-shard": {{"threshold", DefaultLegacyThreshold, true}, {"max-simultaneous", DefaultLegacyMaxSimultaneous, true}},
	"consistent-hashing": {{"virtual-nodes", DefaultVirtualNodes, true}, {"limit", 0, true}},
	"load-aware":         {{"entities-weight", 0, false}, {"hysteresis", DefaultLoadHysteresis, false}, {"max-moves", DefaultLoadMaxMoves, true}},
}

// Names lists the strategies a spec can name.
func Names() []string {
	names := make([]string, 0, len(specs))
	for n := range specs {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// Parse reads a strategy spec, "<name>" or "<name>:<param>=<value>,...",
// for example "least-shard:absolute=20,relative=0.1" (Akka's limits) or "consistent-hashing:limit=10",
// and returns the strategy and the canonical spec (every parameter, in a
// fixed order), which is what a type stores so that every process of it
// can check that it agrees. Parameters and defaults:
//
//	least-shard          absolute=65536 relative=1      (NewLeastShard)
//	legacy-least-shard   threshold=1 max-simultaneous=3 (NewLegacyLeastShard)
//	consistent-hashing   virtual-nodes=100 limit=0      (NewConsistentHashing; 0: unlimited)
//	load-aware           entities-weight=0 hysteresis=0.2 max-moves=256 (NewLoadAware)
func Parse(spec string) (Strategy, string, error) {
	name, rest, hasParams := strings.Cut(strings.TrimSpace(spec), ":")
	params, ok := specs[name]
	if !ok {
		return nil, "", fmt.Errorf("%w: unknown strategy %q (known: %s)", ErrBadSpec, name, strings.Join(Names(), ", "))
	}
	vals := make([]float64, len(params))
	for i, p := range params {
		vals[i] = p.def
	}
	if hasParams {
		for kv := range strings.SplitSeq(rest, ",") {
			k, v, ok := strings.Cut(kv, "=")
			i := slices.IndexFunc(params, func(p param) bool { return p.name == k })
			if !ok || i < 0 {
				return nil, "", fmt.Errorf("%w: %q: %s takes %s", ErrBadSpec, kv, name, paramNames(params))
			}
			f, err := strconv.ParseFloat(v, 64)
			if err != nil || math.IsNaN(f) || math.IsInf(f, 0) || f < 0 || (params[i].int && f != math.Trunc(f)) || f > 1<<30 {
				return nil, "", fmt.Errorf("%w: %s=%q is not a non-negative %s", ErrBadSpec, k, v, map[bool]string{true: "whole number", false: "number"}[params[i].int])
			}
			vals[i] = f
		}
	}
	var b strings.Builder
	b.WriteString(name)
	for i, p := range params {
		b.WriteString(map[bool]string{true: ":", false: ","}[i == 0])
		b.WriteString(p.name + "=" + strconv.FormatFloat(vals[i], 'g', -1, 64))
	}
	var s Strategy
	switch name {
	case "least-shard":
		s = NewLeastShard(int(vals[0]), vals[1])
	case "legacy-least-shard":
		s = NewLegacyLeastShard(int(vals[0]), int(vals[1]))
	case "consistent-hashing":
		s = NewConsistentHashing(int(vals[0]), int(vals[1]))
	case "load-aware":
		s = NewLoadAware(LoadAwareConfig{EntitiesWeight: vals[0], Hysteresis: vals[1], MaxMoves: int(vals[2])})
	}
	return s, b.String(), nil
}

func paramNames(ps []param) string {
	var names []string
	for _, p := range ps {
		names = append(names, p.name)
	}
	return strings.Join(names, ", ")
}
