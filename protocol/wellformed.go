package protocol

import (
	"encoding/binary"
	"fmt"
)

// maxDepth bounds the nesting of containers in a message.
const maxDepth = 32

// wellFormed walks msgpack data without allocating and checks that it is
// exactly one complete value, that no container or string declares more
// elements or bytes than remain in data, and that containers nest at most
// maxDepth deep. The msgpack decoder trusts declared lengths: an 8-byte
// message announcing a 4 GiB string would make it allocate 4 GiB. After
// this check, decoding allocates in proportion to len(data).
func wellFormed(data []byte) error {
	pos := 0
	remaining := []int{1} // values still expected at each open level
	for len(remaining) > 0 {
		top := len(remaining) - 1
		if remaining[top] == 0 {
			remaining = remaining[:top]
			continue
		}
		remaining[top]--
		if pos >= len(data) {
			return fmt.Errorf("truncated at byte %d", pos)
		}
		b := data[pos]
		pos++
		var skip, items int // bytes of payload to skip; child values to expect
		lenOf := func(size int) (int, error) {
			if len(data)-pos < size {
				return 0, fmt.Errorf("truncated length at byte %d", pos)
			}
			var n uint64
			switch size {
			case 1:
				n = uint64(data[pos])
			case 2:
				n = uint64(binary.BigEndian.Uint16(data[pos:]))
			case 4:
				n = uint64(binary.BigEndian.Uint32(data[pos:]))
			}
			pos += size
			if n > uint64(len(data)-pos) {
				return 0, fmt.Errorf("length %d at byte %d exceeds the %d bytes left", n, pos-size-1, len(data)-pos)
			}
			return int(n), nil
		}
		var err error
		switch {
		case b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3: // fixints, nil, bools
		case b >= 0x80 && b <= 0x8f:
			items = 2 * int(b&0x0f)
		case b >= 0x90 && b <= 0x9f:
			items = int(b & 0x0f)
		case b >= 0xa0 && b <= 0xbf:
			skip = int(b & 0x1f)
		case b == 0xc4 || b == 0xd9: // bin8, str8
			skip, err = lenOf(1)
		case b == 0xc5 || b == 0xda: // bin16, str16
			skip, err = lenOf(2)
		case b == 0xc6 || b == 0xdb: // bin32, str32
			skip, err = lenOf(4)
		case b == 0xc7, b == 0xc8, b == 0xc9: // ext8/16/32: length, type, data
			skip, err = lenOf(1 << (b - 0xc7))
			skip++
		case b == 0xca, b == 0xce, b == 0xd2:
			skip = 4
		case b == 0xcb, b == 0xcf, b == 0xd3:
			skip = 8
		case b == 0xcc, b == 0xd0:
			skip = 1
		case b == 0xcd, b == 0xd1:
			skip = 2
		case b >= 0xd4 && b <= 0xd8: // fixext 1, 2, 4, 8, 16: type and data
			skip = 1 + 1<<(b-0xd4)
		case b == 0xdc:
			items, err = lenOf(2)
		case b == 0xdd:
			items, err = lenOf(4)
		case b == 0xde:
			items, err = lenOf(2)
			items *= 2
		case b == 0xdf:
			items, err = lenOf(4)
			items *= 2
		default: // 0xc1 is never used
			return fmt.Errorf("invalid type byte 0x%x at byte %d", b, pos-1)
		}
		if err != nil {
			return err
		}
		if skip > len(data)-pos {
			return fmt.Errorf("truncated value at byte %d", pos)
		}
		pos += skip
		if items > 0 {
			// Every value takes at least one byte.
			if items > len(data)-pos {
				return fmt.Errorf("container of %d values at byte %d exceeds the %d bytes left", items, pos, len(data)-pos)
			}
			if len(remaining) >= maxDepth {
				return fmt.Errorf("nested deeper than %d", maxDepth)
			}
			remaining = append(remaining, items)
		}
	}
	if pos != len(data) {
		return fmt.Errorf("%d bytes of trailing data", len(data)-pos)
	}
	return nil
}
