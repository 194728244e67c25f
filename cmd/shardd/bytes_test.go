package main

import "testing"

func TestParseBytes(t *testing.T) {
	for in, want := range map[string]int64{
		"1073741824": 1 << 30, "1G": 1 << 30, "1GiB": 1 << 30, "1gb": 1 << 30, "512MiB": 512 << 20,
		"64K": 64 << 10, "2T": 2 << 40, "none": -1, "NONE": -1, " 3M ": 3 << 20,
	} {
		if got, err := parseBytes(in); err != nil || got != want {
			t.Errorf("parseBytes(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "0", "-1", "1.5G", "G", "1X", "99999999999T"} {
		if got, err := parseBytes(bad); err == nil {
			t.Errorf("parseBytes(%q) = %d, want an error", bad, got)
		}
	}
	for n, want := range map[int64]string{1 << 30: "1GiB", 3 << 20: "3MiB", 1000: "1000", -1: "none"} {
		b := bytesFlag(n)
		if got := b.String(); got != want {
			t.Errorf("bytesFlag(%d) = %q, want %q", n, got, want)
		}
	}
}
