package campaign

import "strconv"

// Shard is the shard of entity id among n: fnv1a32 of its bytes modulo n
// (docs/PROTOCOL.md, "Shard function"), computed here, not by natshard's
// code, so that the checker depends on the contract alone.
func Shard(id string, n int) int {
	h := uint32(2166136261)
	for i := 0; i < len(id); i++ {
		h ^= uint32(id[i])
		h *= 16777619
	}
	return int(h % uint32(n))
}

// Subject is the data subject of entity id of type typ among n shards,
// under the default data prefix: shard.<type>.<shard>.<id>.
func Subject(typ, id string, n int) string {
	return "shard." + typ + "." + strconv.Itoa(Shard(id, n)) + "." + id
}
