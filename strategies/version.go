package strategies

import (
	"strings"
)

// compareVersions orders application versions: it returns a negative
// number when a is older than b, zero when they are equal and a positive
// number when a is newer.
//
// A version is numeric when, after an optional leading "v", it is one or
// more dot-separated runs of decimal digits. Numeric versions compare part
// by part numerically (missing parts count as 0, so "1.2" equals "1.2.0").
// Non-numeric and empty versions are older than every numeric one and
// compare lexically among themselves.
func compareVersions(a, b string) int {
	if a == b {
		return 0
	}
	pa, aok := versionParts(a)
	pb, bok := versionParts(b)
	switch {
	case aok && bok:
		for i := 0; i < max(len(pa), len(pb)); i++ {
			if c := compareDigits(part(pa, i), part(pb, i)); c != 0 {
				return c
			}
		}
		return 0
	case aok:
		return 1
	case bok:
		return -1
	default:
		return strings.Compare(a, b)
	}
}

// versionParts splits a numeric version into its parts, leading zeros
// removed; ok is false when v is not numeric.
func versionParts(v string) (parts []string, ok bool) {
	v = strings.TrimPrefix(v, "v")
	if v == "" {
		return nil, false
	}
	parts = strings.Split(v, ".")
	for i, p := range parts {
		if p == "" || strings.Trim(p, "0123456789") != "" {
			return nil, false
		}
		parts[i] = strings.TrimLeft(p, "0")
	}
	return parts, true
}

func part(parts []string, i int) string {
	if i < len(parts) {
		return parts[i]
	}
	return ""
}

// compareDigits compares digit strings without leading zeros ("" is 0) as
// numbers of any size.
func compareDigits(a, b string) int {
	if len(a) != len(b) {
		return len(a) - len(b)
	}
	return strings.Compare(a, b)
}
