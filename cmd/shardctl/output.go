package main

import (
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"
)

func writeJSON(out io.Writer, v any) error {
	enc := json.NewEncoder(out)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false) // subjects have '>'
	return enc.Encode(v)
}

// table writes aligned columns; rows are lists of cells.
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
