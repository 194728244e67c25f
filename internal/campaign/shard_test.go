package campaign

import "testing"

// TestShard checks the vectors of docs/PROTOCOL.md, "Shard function".
func TestShard(t *testing.T) {
	for id, want := range map[string]int{"order-42": 116, "user.7": 89, "a": 44, "42": 3} {
		if got := Shard(id, 128); got != want {
			t.Errorf("Shard(%q, 128) = %d, want %d", id, got, want)
		}
	}
	if got, want := Subject("kv", "a", 128), "shard.kv.44.a"; got != want {
		t.Errorf("Subject = %q, want %q", got, want)
	}
}
