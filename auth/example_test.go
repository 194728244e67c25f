package auth_test

import (
	"fmt"
	"strings"

	"github.com/natshard/natshard/auth"
)

// The permissions of each role over type orders with the default
// prefixes, as docs/SECURITY.md lists them.
func ExamplePermissions() {
	for _, role := range auth.Roles {
		p, err := auth.Permissions(role, "u", auth.Scope{Types: []string{"orders"}})
		if err != nil {
			panic(err)
		}
		fmt.Printf("%s\n  publish:\n    %s\n  subscribe:\n    %s\n  answer requests it receives: %v\n",
			role, strings.Join(p.Pub.Allow, "\n    "), strings.Join(p.Sub.Allow, "\n    "), p.Resp != nil)
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
	//     $JS.API.CONSUMER.CREATE.KV_natshard_orders
	//     $JS.API.CONSUMER.CREATE.KV_natshard_orders.>
	//     $JS.API.CONSUMER.CREATE.natshard_buf_orders
	//     $JS.API.CONSUMER.CREATE.natshard_buf_orders.>
	//     $JS.API.CONSUMER.CREATE.natshard_msgs_orders.>
	//     $JS.API.CONSUMER.DELETE.KV_natshard_orders.*
	//     $JS.API.CONSUMER.DELETE.natshard_buf_orders.*
	//     $JS.API.CONSUMER.DELETE.natshard_msgs_orders.*
	//     $JS.API.CONSUMER.INFO.natshard_buf_orders.*
	//     $JS.API.CONSUMER.INFO.natshard_msgs_orders.*
	//     $JS.API.CONSUMER.MSG.NEXT.natshard_buf_orders.*
	//     $JS.API.CONSUMER.MSG.NEXT.natshard_msgs_orders.*
	//     $JS.API.INFO
	//     $JS.API.STREAM.CREATE.KV_natshard_orders
	//     $JS.API.STREAM.CREATE.natshard_buf_orders
	//     $JS.API.STREAM.CREATE.natshard_msgs_orders
	//     $JS.API.STREAM.CREATE.natshard_remind_orders
	//     $JS.API.STREAM.INFO.KV_natshard_orders
	//     $JS.API.STREAM.INFO.natshard_buf_orders
	//     $JS.API.STREAM.INFO.natshard_msgs_orders
	//     $JS.API.STREAM.INFO.natshard_remind_orders
	//     $JS.API.STREAM.MSG.GET.KV_natshard_orders
	//     $JS.API.STREAM.MSG.GET.natshard_buf_orders
	//     $JS.API.STREAM.MSG.GET.natshard_msgs_orders
	//     $JS.API.STREAM.PURGE.natshard_buf_orders
	//     $JS.API.STREAM.PURGE.natshard_remind_orders
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
