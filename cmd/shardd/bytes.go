package main

import (
	"fmt"
	"strconv"
	"strings"
)

// bytesFlag is a size in bytes: a whole number with an optional binary
// suffix, K, M, G or T (KiB, MiB, GiB, TiB and KB, MB, GB, TB mean the
// same, as in nats-server's max_file_store), or "none" for no limit
// (natshard's negative).
type bytesFlag int64

// noLimit is what "none" stands for: the library's "no limit".
const noLimit = -1

var byteUnits = []struct {
	suffix string
	shift  uint
}{{"T", 40}, {"G", 30}, {"M", 20}, {"K", 10}}

func (b *bytesFlag) String() string {
	if int64(*b) < 0 {
		return "none"
	}
	n := int64(*b)
	for _, u := range byteUnits {
		if n != 0 && n%(1<<u.shift) == 0 {
			return strconv.FormatInt(n>>u.shift, 10) + u.suffix + "iB"
		}
	}
	return strconv.FormatInt(n, 10)
}

func (b *bytesFlag) Set(s string) error {
	n, err := parseBytes(s)
	if err != nil {
		return err
	}
	*b = bytesFlag(n)
	return nil
}

// parseBytes reads a bytesFlag's text.
func parseBytes(s string) (int64, error) {
	t := strings.TrimSpace(s)
	if strings.EqualFold(t, "none") {
		return noLimit, nil
	}
	upper := strings.ToUpper(t)
	upper = strings.TrimSuffix(strings.TrimSuffix(upper, "IB"), "B")
	shift := uint(0)
	for _, u := range byteUnits {
		if strings.HasSuffix(upper, u.suffix) {
			upper, shift = strings.TrimSuffix(upper, u.suffix), u.shift
			break
		}
	}
	n, err := strconv.ParseInt(upper, 10, 64)
	if err != nil || n < 1 || n > (1<<62)>>shift {
		return 0, fmt.Errorf("%q is not a size in bytes (like 512MiB, 1G, 1073741824) nor none", s)
	}
	return n << shift, nil
}
