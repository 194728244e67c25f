package protocol

import (
	"strconv"
	"strings"
)

// DefaultShards is the number of shards of a type when none is configured.
const DefaultShards = 128

// MaxShards bounds the shard count of a type.
const MaxShards = 1 << 16

// FNV-1a 32-bit constants, as used by the NATS server's partition() mapping.
const (
	fnvOffset32 = 2166136261
	fnvPrime32  = 16777619
)

// Hash returns the FNV-1a 32-bit hash of the entity id's bytes.
func Hash(id string) uint32 {
	h := uint32(fnvOffset32)
	for i := 0; i < len(id); i++ {
		h ^= uint32(id[i])
		h *= fnvPrime32
	}
	return h
}

// ShardOf returns the shard of entity id among n shards: fnv1a32(id) % n.
// n must be positive.
func ShardOf(id string, n int) int {
	return int(Hash(id) % uint32(n))
}

// checkedShardOf returns the shard of entity id among n shards, as
// ShardOf, or ValidateEntityID's error for an id it refuses: one pass
// over the id for both. n must be positive.
func checkedShardOf(id string, n int) (int, error) {
	h, ok := hashEntityID(id)
	if !ok {
		return 0, ValidateEntityID(id)
	}
	return int(h % uint32(n)), nil
}

// idByte classes the bytes of an entity id for hashEntityID: badByte for
// those refused anywhere in an id (white space, control characters, the
// wildcards), dotByte for '.', which may not begin or end an id nor
// follow another.
const (
	badByte = 1
	dotByte = 2
)

var idByte = func() (t [256]uint8) {
	for c := range 256 {
		if c <= ' ' || c == 0x7f || c == '*' || c == '>' {
			t[c] = badByte
		}
	}
	t['.'] = dotByte
	return t
}()

// hashEntityID is Hash(id) for a valid entity id, and ok false for one
// that is not, in one pass over the id's bytes: every message to an
// entity goes through it (ParseEntity). It holds the rules of an id;
// ValidateEntityID says which one an id breaks.
func hashEntityID(id string) (h uint32, ok bool) {
	if id == "" || len(id) > MaxEntityIDLen || id[0] == '.' || id[len(id)-1] == '.' {
		return 0, false
	}
	h = fnvOffset32
	var bad, last uint8
	for i := 0; i < len(id); i++ {
		c := id[i]
		h = (h ^ uint32(c)) * fnvPrime32
		k := idByte[c]
		bad |= k & (badByte | last) // a bad byte, or a dot after a dot
		last = k
	}
	return h, bad == 0
}

// WorkerID is the entity id of worker index of a sharded daemon whose type
// has shards shards: the decimal index, or, when that does not fall in
// shard index % shards, the index and the first suffix -k that does. So
// worker i lives in shard i % shards, and each of the first shards
// workers has a shard of its own. shards must be positive.
func WorkerID(index, shards int) string {
	id := strconv.Itoa(index)
	want := index % shards
	if ShardOf(id, shards) == want {
		return id
	}
	for k := 1; ; k++ {
		s := id + "-" + strconv.Itoa(k)
		if ShardOf(s, shards) == want {
			return s
		}
	}
}

// WorkerIndex is the index of worker entity id of a sharded daemon whose
// type has shards shards (WorkerID), or -1 when id is no worker's.
func WorkerIndex(id string, shards int) int {
	digits := id
	if i := strings.IndexByte(id, '-'); i >= 0 {
		digits = id[:i]
	}
	i, err := strconv.Atoi(digits)
	if err != nil || i < 0 || i >= MaxWorkers || strconv.Itoa(i) != digits || WorkerID(i, shards) != id {
		return -1
	}
	return i
}
