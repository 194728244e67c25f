package kvstate

import (
	"context"
	"log/slog"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard/protocol"
)

// consumerRoom is the MaxConsumers of the streams that hold a consumer
// per shard: the message stream of durable delivery (one per shard, for
// good) and the buffer (a replay consumer per shard being bound, at most
// 64 per region, and those of replays that ended and that the server has
// not removed yet). Since 2.12 a nats-server allows defaultMaxConsumers
// consumers per stream unless the stream or its account sets a number
// (the server's default_max_consumers), and an unlimited stream (-1) sets
// none: a durable type of more shards could not consume them all, and
// the replays of 1 024 shards bound at once were refused with "maximum
// consumers limit reached" (TestRebalanceAtHandoffSpeed, in CI).
const consumerRoom = 2 * protocol.MaxShards

// defaultMaxConsumers is nats-server's default_max_consumers (2.12 and
// later; older servers have no such limit).
const defaultMaxConsumers = 1000

// codeMaxConsumers is JSMaximumConsumersLimitErr: a consumer over its
// stream's limit, or a stream whose MaxConsumers is over its account's.
const codeMaxConsumers jetstream.ErrorCode = 10026

// createStream creates the stream cfg with room for consumerRoom
// consumers, or, where its account allows fewer, under the account's
// limit (warnConsumerRoom then says so).
func createStream(ctx context.Context, js jetstream.JetStream, cfg jetstream.StreamConfig) (jetstream.Stream, error) {
	cfg.MaxConsumers = consumerRoom
	st, err := js.CreateStream(ctx, cfg)
	if apiCode(err) == codeMaxConsumers {
		cfg.MaxConsumers = 0
		st, err = js.CreateStream(ctx, cfg)
	}
	return st, err
}

// warnConsumerRoom warns when the stream of info, which has a consumer
// per shard, may refuse the consumers of shards shards: a stream created
// by an older natshard (an existing stream is bound as it is), or under
// an account's lower limit.
func warnConsumerRoom(ctx context.Context, js jetstream.JetStream, log *slog.Logger, info *jetstream.StreamInfo, shards int) {
	if log == nil || shards <= 0 {
		return
	}
	room := info.Config.MaxConsumers
	if room <= 0 {
		room = defaultMaxConsumers
		if acc, err := js.AccountInfo(ctx); err == nil && acc.Limits.MaxConsumers > 0 {
			room = min(room, acc.Limits.MaxConsumers)
		}
	}
	if shards <= room {
		return
	}
	log.Warn("the stream may refuse consumers: it needs one per shard, and allows fewer; raise its limit with nats stream edit --max-consumers, and the account's",
		"stream", info.Config.Name, "shards", shards, "max_consumers", room)
}
