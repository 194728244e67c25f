// Package send is natshard for programs that only send to entities: the
// Client, typed keys and references (Key, Ref: Ask and Tell), the codecs,
// and the errors that cross the wire (Error, EntityError). It does not
// link the NATS server (TestNoServerDependency checks it); package
// natshard, which hosts entities, gives the same names as aliases.
//
//	nc, err := nats.Connect(url)
//	client := send.NewClient(nc)
//	account := send.NewKey[Request, Reply]("account").Ref(client, "alice")
//	reply, err := account.Ask(ctx, Request{Op: "withdraw", Amount: 50}, send.MsgID("op-1"))
//	if errors.Is(err, ErrInsufficientFunds) { ... } // send.NewError("insufficient-funds", ...)
//
// A request is the request value encoded by the key's codec (JSON by
// default) on the entity's subject, shard.<type>.<shard>.<id>; a reply
// the reply value so encoded; an error answer carries its code in the
// Natshard-Error-Code header (docs/PROTOCOL.md).
package send
