package protocol

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
