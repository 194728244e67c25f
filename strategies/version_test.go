package strategies

import "testing"

func TestCompareVersions(t *testing.T) {
	// Each row: a is older than b.
	older := []struct{ a, b string }{
		{"1.9.3", "1.10.0"},
		{"1.2.3", "1.2.4"},
		{"1.2", "1.2.1"},
		{"v1.9", "1.10"},
		{"1.9", "v1.10"},
		{"9.9.9", "10"},
		{"0.0.1", "99999999999999999999999"}, // no overflow
		{"99999999999999999999998", "99999999999999999999999"},
		{"", "0"},
		{"", "alpha"},
		{"alpha", "beta"},
		{"latest", "0.0.1"},
		{"1.2.3-rc1", "0.1"}, // not numeric
		{"1..2", "1.0.2"},    // empty part: not numeric
		{"v", "1"},
		{"1.", "1.0"},
	}
	for _, tc := range older {
		if c := compareVersions(tc.a, tc.b); c >= 0 {
			t.Errorf("compareVersions(%q, %q) = %d, want < 0", tc.a, tc.b, c)
		}
		if c := compareVersions(tc.b, tc.a); c <= 0 {
			t.Errorf("compareVersions(%q, %q) = %d, want > 0", tc.b, tc.a, c)
		}
	}
	equal := []struct{ a, b string }{
		{"", ""},
		{"1.2.3", "1.2.3"},
		{"v1.2.3", "1.2.3"},
		{"1.2", "1.2.0"},
		{"01.002", "1.2"},
		{"abc", "abc"},
	}
	for _, tc := range equal {
		if c := compareVersions(tc.a, tc.b); c != 0 {
			t.Errorf("compareVersions(%q, %q) = %d, want 0", tc.a, tc.b, c)
		}
		if c := compareVersions(tc.b, tc.a); c != 0 {
			t.Errorf("compareVersions(%q, %q) = %d, want 0", tc.b, tc.a, c)
		}
	}
}
