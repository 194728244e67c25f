package auth_test

import (
	"fmt"
	"regexp"
	"slices"
	"strings"

	"github.com/natshard/natshard/auth"
)

var splitStream = regexp.MustCompile(`~[0-9]+`)

// The permissions of each role over type orders with the default
// prefixes, as docs/SECURITY.md lists them.
func ExamplePermissions() {
	for _, role := range auth.Roles {
		p, err := auth.Permissions(role, "u", auth.Scope{Types: []string{"orders"}})
		if err != nil {
			panic(err)
		}
		// The streams a type's messages may be split over,
		// natshard_msgs_orders~0 to ~15, once each as ~N.
		var pub []string
		for _, subj := range p.Pub.Allow {
			subj = splitStream.ReplaceAllString(subj, "~N")
			if !slices.Contains(pub, subj) {
				pub = append(pub, subj)
			}
		}
		fmt.Printf("%s\n  publish:\n    %s\n  subscribe:\n    %s\n  answer requests it receives: %v\n",
			role, strings.Join(pub, "\n    "), strings.Join(p.Sub.Allow, "\n    "), p.Resp != nil)
	}
	// Output:
	// publisher
	//   publish:
	//     shard.orders.>
	//   subscribe:
	//     _INBOX.>
	//   answer requests it receives: false
	// region
	//   publish:
	//     $JS.ACK.natshard_msgs_orders.>
	//     $JS.ACK.natshard_msgs_orders~N.>
	//     $JS.API.CONSUMER.CREATE.KV_natshard_orders
	//     $JS.API.CONSUMER.CREATE.KV_natshard_orders.>
	//     $JS.API.CONSUMER.CREATE.natshard_buf_orders
	//     $JS.API.CONSUMER.CREATE.natshard_buf_orders.>
	//     $JS.API.CONSUMER.CREATE.natshard_msgs_orders.>
	//     $JS.API.CONSUMER.CREATE.natshard_msgs_orders~N.>
	//     $JS.API.CONSUMER.DELETE.KV_natshard_orders.*
	//     $JS.API.CONSUMER.DELETE.natshard_buf_orders.*
	//     $JS.API.CONSUMER.DELETE.natshard_msgs_orders.*
	//     $JS.API.CONSUMER.DELETE.natshard_msgs_orders~N.*
	//     $JS.API.CONSUMER.INFO.natshard_buf_orders.*
	//     $JS.API.CONSUMER.INFO.natshard_msgs_orders.*
	//     $JS.API.CONSUMER.INFO.natshard_msgs_orders~N.*
	//     $JS.API.CONSUMER.MSG.NEXT.natshard_buf_orders.*
	//     $JS.API.CONSUMER.MSG.NEXT.natshard_msgs_orders.*
	//     $JS.API.CONSUMER.MSG.NEXT.natshard_msgs_orders~N.*
	//     $JS.API.INFO
	//     $JS.API.STREAM.CREATE.KV_natshard_orders
	//     $JS.API.STREAM.CREATE.natshard_buf_orders
	//     $JS.API.STREAM.CREATE.natshard_msgs_orders
	//     $JS.API.STREAM.CREATE.natshard_msgs_orders~N
	//     $JS.API.STREAM.CREATE.natshard_remind_orders
	//     $JS.API.STREAM.INFO.KV_natshard_orders
	//     $JS.API.STREAM.INFO.natshard_buf_orders
	//     $JS.API.STREAM.INFO.natshard_msgs_orders
	//     $JS.API.STREAM.INFO.natshard_msgs_orders~N
	//     $JS.API.STREAM.INFO.natshard_remind_orders
	//     $JS.API.STREAM.MSG.GET.KV_natshard_orders
	//     $JS.API.STREAM.MSG.GET.natshard_buf_orders
	//     $JS.API.STREAM.MSG.GET.natshard_msgs_orders
	//     $JS.API.STREAM.MSG.GET.natshard_msgs_orders~N
	//     $JS.API.STREAM.PURGE.natshard_buf_orders
	//     $JS.API.STREAM.PURGE.natshard_remind_orders
	//     $JS.API.STREAM.UPDATE.natshard_msgs_orders~N
	//     $JS.FC.*.*.KV_natshard_orders.>
	//     $JS.FC.KV_natshard_orders.>
	//     $KV.natshard_orders.>
	//     $SHARD.orders.admin.status
	//     $SHARD.orders.buf.*.*
	//     $SHARD.orders.coordinator.*
	//     $SHARD.orders.events
	//     $SHARD.orders.query.*
	//     $SHARD.orders.region.*
	//     $SHARD.orders.remind.>
	//     _INBOX.>
	//     _INBOX_natshard.>
	//     shard.orders.>
	//   subscribe:
	//     $SHARD.orders.admin.>
	//     $SHARD.orders.coordinator.*
	//     $SHARD.orders.events
	//     $SHARD.orders.query.*
	//     $SHARD.orders.region.*
	//     _INBOX_natshard.u.>
	//     shard.orders.>
	//   answer requests it receives: true
	// admin
	//   publish:
	//     $JS.API.CONSUMER.CREATE.KV_natshard_orders
	//     $JS.API.CONSUMER.CREATE.KV_natshard_orders.>
	//     $JS.API.CONSUMER.DELETE.KV_natshard_orders.*
	//     $JS.API.STREAM.INFO.KV_natshard_orders
	//     $JS.API.STREAM.INFO.natshard_buf_orders
	//     $JS.API.STREAM.INFO.natshard_msgs_orders
	//     $JS.API.STREAM.INFO.natshard_msgs_orders~N
	//     $JS.API.STREAM.MSG.GET.KV_natshard_orders
	//     $JS.FC.*.*.KV_natshard_orders.>
	//     $JS.FC.KV_natshard_orders.>
	//     $SHARD.orders.admin.>
	//     $SHARD.orders.query.*
	//     shard.orders.>
	//   subscribe:
	//     $SHARD.orders.events
	//     _INBOX_natshard.u.>
	//   answer requests it receives: false
}
