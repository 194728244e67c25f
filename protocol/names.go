package protocol

import (
	"fmt"
	"strings"
)

// MaxNameLen bounds type names and region ids.
const MaxNameLen = 64

// MaxEntityIDLen bounds entity ids, in bytes.
const MaxEntityIDLen = 256

// ValidateName checks a type name or region id: 1 to MaxNameLen characters
// from [A-Za-z0-9_-]. Such names are valid subject tokens, KV key parts and
// stream names at once.
func ValidateName(what, s string) error {
	if s == "" {
		return fmt.Errorf("%w: %s is empty", ErrInvalidName, what)
	}
	if len(s) > MaxNameLen {
		return fmt.Errorf("%w: %s %q is longer than %d characters", ErrInvalidName, what, s, MaxNameLen)
	}
	for i := 0; i < len(s); i++ {
		if !isNameByte(s[i]) {
			return fmt.Errorf("%w: %s %q has %q; use letters, digits, '-' and '_'", ErrInvalidName, what, s, s[i])
		}
	}
	return nil
}

func isNameByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_'
}

// ValidateEntityID checks that id can be the tail of a data subject: one or
// more non-empty tokens separated by dots, no white space or control
// characters, no wildcard characters ('*', '>'), at most MaxEntityIDLen bytes.
// The rules are hashEntityID's (idByte); this says which one id breaks.
func ValidateEntityID(id string) error {
	if _, ok := hashEntityID(id); ok {
		return nil
	}
	switch {
	case id == "":
		return fmt.Errorf("%w: empty", ErrInvalidEntityID)
	case len(id) > MaxEntityIDLen:
		return fmt.Errorf("%w: %d bytes, at most %d", ErrInvalidEntityID, len(id), MaxEntityIDLen)
	}
	for i := 0; i < len(id); i++ {
		switch c := id[i]; idByte[c] {
		case badByte:
			if c == '*' || c == '>' {
				return fmt.Errorf("%w: %q has a wildcard character %q", ErrInvalidEntityID, id, c)
			}
			return fmt.Errorf("%w: %q has white space or a control character", ErrInvalidEntityID, id)
		case dotByte:
			if i == 0 || id[i-1] == '.' {
				return fmt.Errorf("%w: %q has an empty token", ErrInvalidEntityID, id)
			}
		}
	}
	return fmt.Errorf("%w: %q ends with a dot", ErrInvalidEntityID, id)
}

// validatePrefix checks a subject prefix: dot-separated tokens without
// wildcards or white space.
func validatePrefix(what, p string) error {
	if p == "" {
		return fmt.Errorf("%w: %s prefix is empty", ErrInvalidName, what)
	}
	for _, tok := range strings.Split(p, ".") {
		if tok == "" || strings.ContainsAny(tok, "*> \t\r\n") {
			return fmt.Errorf("%w: %s prefix %q is not a literal subject", ErrInvalidName, what, p)
		}
	}
	return nil
}
