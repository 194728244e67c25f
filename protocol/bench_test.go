package protocol

import (
	"strconv"
	"testing"
)

// Benchmarks of the hot path's protocol work: every message to an entity
// is parsed (ParseEntity, which includes ShardOf and the id check), and
// publishers that use the library build its subject (EntityOf). Control
// messages (Command, Reply) go through Encode and Decode at every probe,
// every 500 ms per region, and at every move. Run with
//
//	go test -run '^$' -bench . -benchmem ./protocol/

var (
	sinkInt int
	sinkStr string
	sinkErr error
)

func BenchmarkShardOf(b *testing.B) {
	for b.Loop() {
		sinkInt = ShardOf("order-4242", DefaultShards)
	}
}

func BenchmarkParseEntity(b *testing.B) {
	s := MustSubjects("", "", "orders")
	for _, id := range []string{"order-4242", "tenant-7.customer-12345.order-987654"} {
		subject := s.EntityOf(id, DefaultShards)
		b.Run(strconv.Itoa(len(id))+"B", func(b *testing.B) {
			for b.Loop() {
				sinkInt, sinkStr, sinkErr = s.ParseEntity(subject, DefaultShards)
			}
			if sinkErr != nil || sinkStr != id {
				b.Fatal(sinkStr, sinkErr)
			}
		})
	}
}

func BenchmarkEntityOf(b *testing.B) {
	s := MustSubjects("", "", "orders")
	for b.Loop() {
		sinkStr = s.EntityOf("order-4242", DefaultShards)
	}
}

// controlMessages are typical control messages: a bind of 12 shards (a
// rebalance round's moves to one region) and a probe answer with the load
// of 64 shards.
func controlMessages() (Command, Reply) {
	cmd := Command{Kind: CmdBind, Epoch: 123456, Coordinator: "region-a", Incarnation: "Hx3mZ1kq0pT7yB2cN9vR4e"}
	reply := Reply{Epoch: 123456, Incarnation: "Hx3mZ1kq0pT7yB2cN9vR4e"}
	for i := range 12 {
		cmd.Shards = append(cmd.Shards, i*10)
		cmd.Handoffs = append(cmd.Handoffs, uint64(1000+i))
	}
	for i := range 64 {
		reply.Held = append(reply.Held, i)
		reply.Load = append(reply.Load, ShardLoad{Shard: i, Rate: 123.5, Entities: 80})
	}
	return cmd, reply
}

func BenchmarkEncode(b *testing.B) {
	cmd, reply := controlMessages()
	b.Run("command", func(b *testing.B) {
		for b.Loop() {
			if _, err := Encode(cmd); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("reply", func(b *testing.B) {
		for b.Loop() {
			if _, err := Encode(reply); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func BenchmarkDecode(b *testing.B) {
	cmd, reply := controlMessages()
	cdata, _ := Encode(cmd)
	rdata, _ := Encode(reply)
	b.Run("command", func(b *testing.B) {
		for b.Loop() {
			var c Command
			if err := Decode(cdata, &c); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("reply", func(b *testing.B) {
		for b.Loop() {
			var r Reply
			if err := Decode(rdata, &r); err != nil {
				b.Fatal(err)
			}
		}
	})
	// The well-formedness walk that guards Decode against hostile lengths.
	b.Run("wellformed-reply", func(b *testing.B) {
		for b.Loop() {
			if err := wellFormed(rdata); err != nil {
				b.Fatal(err)
			}
		}
	})
}
