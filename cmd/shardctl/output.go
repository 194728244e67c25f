package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"unicode"
	"unicode/utf8"
)

// What shardctl prints comes from the network: region ids, states, notes
// and errors from the coordinator, entity ids and answers, events that
// anyone allowed to publish on the events subject may forge. None of it
// reaches the terminal raw: control characters (C0, DEL, C1), Unicode's
// bidirectional controls and invalid UTF-8 are printed as Go escapes
// (\x1b, \u202e), so a forged field can neither drive the terminal
// (move the cursor, recolour, retitle, rewrite the line) nor reorder
// what is shown. Tables and plain lines go through clean (or say), JSON
// through writeJSON, and multi-line text (answers, errors) through
// cleanText, which keeps newlines and tabs.

// clean escapes every control character of s, newlines and tabs included:
// for table cells and single-line fields.
func clean(s string) string { return escape(s, false) }

// cleanText escapes the control characters of s but newlines and tabs.
func cleanText(s string) string { return escape(s, true) }

func escape(s string, keepLines bool) string {
	safe := true
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c >= 0x7f {
			safe = false
			break
		}
	}
	if safe {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case keepLines && (r == '\n' || r == '\t'):
			b.WriteRune(r)
		case unsafeRune(r) && r < 0x100:
			fmt.Fprintf(&b, `\x%02x`, r)
		case unsafeRune(r):
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteString(s[i : i+size])
		}
		i += size
	}
	return b.String()
}

// unsafeRune: a control character, or a bidirectional formatting
// character (they reorder what follows: "Trojan Source").
func unsafeRune(r rune) bool {
	return unicode.IsControl(r) || unicode.Is(unicode.Bidi_Control, r)
}

// say is fmt.Fprintf whose string arguments (strings, errors, Stringers)
// are cleaned: for lines that show what the network sent.
func say(out io.Writer, format string, args ...any) {
	for i, a := range args {
		switch v := a.(type) {
		case string:
			args[i] = clean(v)
		case error:
			args[i] = clean(v.Error())
		case fmt.Stringer:
			args[i] = clean(v.String())
		}
	}
	fmt.Fprintf(out, format, args...)
}

// writeJSON prints v as indented JSON. encoding/json escapes C0 control
// characters and replaces invalid UTF-8, but leaves DEL, C1 controls and
// bidirectional controls raw; jsonSafe escapes those too.
func writeJSON(out io.Writer, v any) error {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false) // subjects have '>'
	if err := enc.Encode(v); err != nil {
		return err
	}
	_, err := out.Write(jsonSafe(buf.Bytes()))
	return err
}

// jsonSafe escapes, in JSON text, what encoding/json leaves raw and a
// terminal may act on: DEL, C1 controls, bidirectional controls (as \u
// escapes) and invalid UTF-8 (as \ufffd). In valid JSON such characters
// can stand only inside strings, where the escapes mean the same.
func jsonSafe(data []byte) []byte {
	var b []byte
	for i := 0; i < len(data); {
		r, size := utf8.DecodeRune(data[i:])
		esc := ""
		switch {
		case r == utf8.RuneError && size == 1:
			esc = `\ufffd`
		case r >= 0x7f && unsafeRune(r):
			esc = fmt.Sprintf(`\u%04x`, r)
		}
		if esc != "" && b == nil {
			b = append(make([]byte, 0, len(data)+16), data[:i]...)
		}
		switch {
		case esc != "":
			b = append(b, esc...)
		case b != nil:
			b = append(b, data[i:i+size]...)
		}
		i += size
	}
	if b == nil {
		return data
	}
	return b
}

// table writes aligned columns; rows are lists of cells. String cells are
// cleaned.
func table(out io.Writer, header []string, rows [][]any) error {
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	for i, h := range header {
		if i > 0 {
			fmt.Fprint(tw, "\t")
		}
		fmt.Fprint(tw, h)
	}
	fmt.Fprintln(tw)
	for _, r := range rows {
		for i, cell := range r {
			if i > 0 {
				fmt.Fprint(tw, "\t")
			}
			if s, ok := cell.(string); ok {
				cell = clean(s)
			}
			fmt.Fprint(tw, cell)
		}
		fmt.Fprintln(tw)
	}
	return tw.Flush()
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// kvNote says that a view was read from KV because no coordinator
// answered, as a "note:" line padded to width like the lines before it.
func kvNote(out io.Writer, v view, width int) {
	if !v.Answered {
		fmt.Fprintf(out, "%-*sno coordinator answered; this is what KV holds\n", width, "note:")
	}
}
