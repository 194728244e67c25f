package protocol

import "testing"

func TestShardOfVectors(t *testing.T) {
	for _, tc := range []struct {
		id   string
		want int
	}{
		{"order-42", 116},
		{"user.7", 89},
		{"a", 44},
		{"42", 3},
	} {
		if got := ShardOf(tc.id, 128); got != tc.want {
			t.Errorf("ShardOf(%q, 128) = %d, want %d", tc.id, got, tc.want)
		}
	}
}
