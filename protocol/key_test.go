package protocol

import (
	"testing"

	"github.com/nats-io/nats.go"
)

func TestMessageKey(t *testing.T) {
	id := nats.Header{HeaderMsgID: {"m1"}}
	for _, tc := range []struct {
		header nats.Header
		reply  string
		want   string
	}{
		{id, "", "m1"},
		{id, "_INBOX.abc.~7", "m1"}, // the header first
		{nil, "_INBOX.abc.~7", "_INBOX.abc.~7"},
		{nil, "~7", "~7"},
		{nats.Header{"Other": {"x"}}, "_INBOX.abc.~", "_INBOX.abc.~"},
		{nil, "", ""},
		{nil, "_INBOX.abc.7", ""},  // nats.go's own replies: no promise
		{nil, "replies.all", ""},   // a reply subject shared by many messages
		{nil, "_INBOX.~abc.7", ""}, // the mark is on the last token only
		{nil, "_INBOX.abc.7~", ""}, // at its start
		{nats.Header{HeaderMsgID: {""}}, "r.1", ""},
	} {
		if got := MessageKey(tc.header, tc.reply); got != tc.want {
			t.Errorf("MessageKey(%v, %q) = %q, want %q", tc.header, tc.reply, got, tc.want)
		}
	}
}
