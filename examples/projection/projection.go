// Package projection is a sharded daemon (natshard.Daemon): Partitions
// workers, worker i consuming partition i of the ORDERS stream and keeping
// each order's last status in the KV bucket order_status.
//
// An order's events are published to orders.<partition>.<order id>, the
// partition a function of the order id (the NATS server's partition()
// subject mapping computes one: orders.* to
// orders.{{partition(4,1)}}.{{wildcard(1)}}), so all the events of an
// order are in one partition, in order. Each partition has one consumer,
// with one message in flight: its events are applied in order. natshard
// keeps each worker running in one process at a time, across processes
// that join, leave and crash: two workers of one partition, at once,
// would share its consumer and apply an order's events out of order.
package projection

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/natshard/natshard"
)

// Partitions is the number of partitions of the orders, and of workers.
const Partitions = 4

// Daemon is the projection: host it with natshard.Start(ctx, opts,
// projection.Daemon.Type()).
var Daemon = natshard.Daemon{Name: "projection", Workers: Partitions, Run: Run}

// Run is worker index: it applies partition index's events, one at a
// time, from where the partition's last worker left off (a durable
// consumer per partition), until ctx ends.
func Run(ctx context.Context, index int) error {
	js, err := jetstream.New(natshard.EnvFrom(ctx).Conn)
	if err != nil {
		return err
	}
	stream, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.*.*"}})
	if err != nil {
		return err
	}
	status, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "order_status"})
	if err != nil {
		return err
	}
	consumer, err := stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{
		Durable:       fmt.Sprintf("projection-%d", index),
		FilterSubject: fmt.Sprintf("orders.%d.*", index),
		AckPolicy:     jetstream.AckExplicitPolicy,
		MaxAckPending: 1,               // one event in flight: in order
		AckWait:       5 * time.Second, // an event lost with a crashed worker comes again then
	})
	if err != nil {
		return err
	}
	for ctx.Err() == nil {
		// Half a second at most, so that Run returns promptly once ctx
		// ends; an event fetched is applied, whatever ctx.
		m, err := consumer.Next(jetstream.FetchMaxWait(500 * time.Millisecond))
		if errors.Is(err, nats.ErrTimeout) {
			continue
		}
		if err != nil {
			return err
		}
		if err := apply(status, m); err != nil {
			return err
		}
	}
	return nil
}

// apply keeps the event's status as its order's, and acknowledges it.
func apply(status jetstream.KeyValue, m jetstream.Msg) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	order := m.Subject()[strings.LastIndexByte(m.Subject(), '.')+1:]
	if _, err := status.Put(ctx, order, m.Data()); err != nil {
		_ = m.Nak() // at once to the partition's next worker
		return err
	}
	return m.DoubleAck(ctx)
}
