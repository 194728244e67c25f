package protocol

import (
	"fmt"
	"strconv"
	"strings"
)

// Default subject prefixes.
const (
	DefaultDataPrefix    = "shard"
	DefaultControlPrefix = "$SHARD"
)

// Header names natshard sets on messages.
const (
	// HeaderError is set on the reply to a request that natshard could not
	// route or that an entity failed; its value says why.
	HeaderError = "Natshard-Error"
	// HeaderErrorCode is set, beside HeaderError, on an entity's error
	// answer whose error has a code (ErrorCode): a short token such as
	// "insufficient-funds" that a requester in any language matches on,
	// where HeaderError's text is for people.
	HeaderErrorCode = "Natshard-Error-Code"
	// HeaderRefused is set, beside HeaderError, on the reply to a request
	// that no entity handled: its value is one of the Refused* reasons.
	// A request refused for any reason but RefusedMalformed may be sent
	// again as it is: nothing was done with it.
	HeaderRefused = "Natshard-Refused"
	// HeaderMsgID is the JetStream de-duplication header publishers may set;
	// handoff replay uses it to drop duplicates.
	HeaderMsgID = "Nats-Msg-Id"
	// HeaderSubject and HeaderReply carry a buffered message's original
	// subject and reply subject in the buffer stream.
	HeaderSubject = "Natshard-Subject"
	HeaderReply   = "Natshard-Reply"
	// HeaderAppliedSeq is stored with an entity's state in durable
	// delivery: the stream sequence of the last message the state applied.
	HeaderAppliedSeq = "Natshard-Applied-Seq"
	// HeaderMarker marks an end marker in a shard's buffer; its value is
	// the handoff id.
	HeaderMarker = "Natshard-Marker"
	// HeaderSource is set on a message that a paused source region
	// appended to a shard's buffer; its value is the handoff id it paused
	// for. HeaderFence marks a fence in a shard's buffer (its own subject,
	// Subjects.BufferFence): the coordinator took the shard from the source
	// of that handoff id without its consent, and a replay skips every
	// message of that source stored after the fence (PROTOCOL.md, Epochs
	// and fencing).
	HeaderSource = "Natshard-Source"
	HeaderFence  = "Natshard-Fence"
	// HeaderReminder is set on a message that a reminder sent to its
	// entity (durable delivery); its value is the reminder's name.
	HeaderReminder = "Natshard-Reminder"
	// HeaderAnswerOf asks an entity for the answer it gave to the message
	// whose idempotency key is its value (IdempotencyKey), without
	// applying anything: a requester whose message the stream dropped as
	// a duplicate of one stored before sends it (durable delivery). The
	// entity answers it with the stored answer, or with the refusal
	// RefusedNoAnswer when it keeps none for that key.
	HeaderAnswerOf = "Natshard-Answer-Of"
	// HeaderAnswers is stored with an entity's state (persistent
	// entities): the answers to the last keyed messages the state
	// applied, a JSON array of {"key","data" (base64),"error"}.
	HeaderAnswers = "Natshard-Answers"
	// HeaderForwarded is set on a message of durable delivery that a
	// parent shard's owner moved onto a child's subject after a split
	// (PROTOCOL.md, Resharding): its value is the stream sequence of the
	// message it copies. HeaderKey carries the copied message's
	// idempotency key (its Nats-Msg-Id, which the copy cannot keep: the
	// stream would drop the copy as a duplicate of the original).
	HeaderForwarded = "Natshard-Forwarded"
	HeaderKey       = "Natshard-Key"
)

// Subjects builds and parses the subjects of one entity type.
//
// Data plane:
//
//	<data>.<type>.<shard>.<entity id...>   messages to entities
//	<data>.<type>.<shard>.>                what a region subscribes per shard
//
// Control plane (msgpack unless noted):
//
//	<control>.<type>.region.<region id>    coordinator -> region commands
//	<control>.<type>.query.<region id>     region query, JSON (shardctl, nats req)
//	<control>.<type>.admin.<verb>          admin API, JSON (shardctl, nats req)
//	<control>.<type>.events                coordinator's events, JSON (shardctl watch)
//	<control>.<type>.buf.<shard>.m         the shard's buffered messages (JetStream)
//	<control>.<type>.buf.<shard>.e         the shard's end markers (JetStream)
//	<control>.<type>.remind.<shard>.<name>.<entity id...>
//	                                       an entity's reminder (JetStream message schedule)
//	<control>.<type>.fired.<shard>.<entity id...>
//	                                       a due reminder, on its way to the entity
type Subjects struct {
	data    string // "<data>.<type>."
	control string // "<control>.<type>."
	typ     string
}

// NewSubjects returns the subjects of type typ under the given prefixes;
// empty prefixes take the defaults.
func NewSubjects(dataPrefix, controlPrefix, typ string) (Subjects, error) {
	if dataPrefix == "" {
		dataPrefix = DefaultDataPrefix
	}
	if controlPrefix == "" {
		controlPrefix = DefaultControlPrefix
	}
	if err := ValidateName("type", typ); err != nil {
		return Subjects{}, err
	}
	if err := validatePrefix("data", dataPrefix); err != nil {
		return Subjects{}, err
	}
	if err := validatePrefix("control", controlPrefix); err != nil {
		return Subjects{}, err
	}
	if dataPrefix == controlPrefix {
		return Subjects{}, fmt.Errorf("%w: data and control prefixes are both %q", ErrInvalidName, dataPrefix)
	}
	return Subjects{data: dataPrefix + "." + typ + ".", control: controlPrefix + "." + typ + ".", typ: typ}, nil
}

// MustSubjects is NewSubjects for constant arguments known to be valid; it
// panics otherwise. For tests and defaults only.
func MustSubjects(dataPrefix, controlPrefix, typ string) Subjects {
	s, err := NewSubjects(dataPrefix, controlPrefix, typ)
	if err != nil {
		panic(err)
	}
	return s
}

// Type is the entity type these subjects belong to.
func (s Subjects) Type() string { return s.typ }

// Entity is the data subject of entity id in shard.
func (s Subjects) Entity(shard int, id string) string {
	var n [20]byte // the shard's digits, without a string of their own
	return s.data + string(strconv.AppendInt(n[:0], int64(shard), 10)) + "." + id
}

// EntityOf is the data subject of entity id among n shards.
func (s Subjects) EntityOf(id string, n int) string {
	return s.Entity(ShardOf(id, n), id)
}

// Shard is the subscription subject of a whole shard.
func (s Subjects) Shard(shard int) string {
	return s.data + strconv.Itoa(shard) + ".>"
}

// AllData matches every data subject of the type.
func (s Subjects) AllData() string { return s.data + ">" }

// Region is the command subject of region id.
func (s Subjects) Region(id string) string { return s.control + "region." + id }

// Query is the subject on which region id answers queries about its
// shards and entities (JSON, QueryRequest -> QueryAnswer).
func (s Subjects) Query(id string) string { return s.control + "query." + id }

// Events is the subject on which the coordinator leader publishes what it
// does (JSON Event): shard table changes, regions, pins.
func (s Subjects) Events() string { return s.control + "events" }

// Buffer is the subject of a shard's buffered messages in the buffer
// stream.
func (s Subjects) Buffer(shard int) string { return s.control + "buf." + strconv.Itoa(shard) + ".m" }

// BufferMarker is the subject of a shard's end markers in the buffer
// stream. Markers have their own subject so that a full buffer (the limit
// is per subject) still takes the marker that ends its handoff.
func (s Subjects) BufferMarker(shard int) string {
	return s.control + "buf." + strconv.Itoa(shard) + ".e"
}

// BufferFence is the subject of a shard's fences in the buffer stream. It
// matches BufferShard, so a replay reads fences in stream order, but a
// purge leaves it alone (kvstate.Buffer.Purge): a fence must outlive the
// purges of the moves after it, or a zombie source's late append would be
// replayed by a later owner.
func (s Subjects) BufferFence(shard int) string {
	return s.control + "buf." + strconv.Itoa(shard) + ".f"
}

// BufferShard matches a shard's messages, markers and fences, in stream
// order.
func (s Subjects) BufferShard(shard int) string {
	return s.control + "buf." + strconv.Itoa(shard) + ".*"
}

// BufferAll matches the buffer subjects of every shard: the buffer
// stream's subjects.
func (s Subjects) BufferAll() string { return s.control + "buf.*.*" }

// Reminder is the subject of entity id's reminder name in the type's
// message stream (durable delivery): a JetStream message schedule whose
// target is the entity's data subject. name is a single token
// (ValidateName), so the subject names one reminder of one entity.
func (s Subjects) Reminder(shard int, name, id string) string {
	return s.control + "remind." + strconv.Itoa(shard) + "." + name + "." + id
}

// AllReminders matches every reminder subject of the type (the
// reminders' stream holds them).
func (s Subjects) AllReminders() string { return s.control + "remind.>" }

// Fired is the subject on which a due reminder of entity id in shard is
// stored in the reminders' stream, before the message stream takes it
// onto the entity's data subject (Entity).
func (s Subjects) Fired(shard int, id string) string {
	return s.control + "fired." + strconv.Itoa(shard) + "." + id
}

// FiredIn is the subject on which a due reminder of entity id in shard
// is stored when the type's messages are split over several streams:
// part is the shard's stream (shard mod their number), whose source of the
// reminders' stream takes FiredPart(part) onto the entities' data
// subjects.
func (s Subjects) FiredIn(part, shard int, id string) string {
	return s.control + "fired." + strconv.Itoa(part) + "." + strconv.Itoa(shard) + "." + id
}

// FiredPart matches the fired reminders stored for the message stream
// part (FiredIn); its second token is the shard.
func (s Subjects) FiredPart(part int) string {
	return s.control + "fired." + strconv.Itoa(part) + ".*.>"
}

// AllFired matches every fired reminder of the type.
func (s Subjects) AllFired() string { return s.control + "fired.>" }

// Coordinator is the subject on which the coordinator candidate with probe
// id id answers "are you there" (CoordinatorInfo.Probe). "No responders"
// there means its connection is gone from the servers.
func (s Subjects) Coordinator(id string) string { return s.control + "coordinator." + id }

// Admin is the subject of an admin API verb.
func (s Subjects) Admin(verb string) string { return s.control + "admin." + verb }

// AdminAll matches every admin API verb.
func (s Subjects) AdminAll() string { return s.control + "admin.>" }

// ParseEntity splits a data subject of this type into its shard and entity
// id, and checks that the id is valid and belongs to the shard among n
// shards. The error says which part is wrong.
func (s Subjects) ParseEntity(subject string, n int) (shard int, id string, err error) {
	rest, ok := strings.CutPrefix(subject, s.data)
	if !ok {
		return 0, "", fmt.Errorf("%w: %q is not under %q", ErrInvalidSubject, subject, s.data)
	}
	tok, id, ok := strings.Cut(rest, ".")
	if !ok {
		return 0, "", fmt.Errorf("%w: %q has no entity id", ErrInvalidSubject, subject)
	}
	shard, err = parseShard(tok, n)
	if err != nil {
		return 0, "", fmt.Errorf("%w: %q: %v", ErrInvalidSubject, subject, err)
	}
	want, err := checkedShardOf(id, n)
	if err != nil {
		return 0, "", err
	}
	if want != shard {
		return 0, "", fmt.Errorf("%w: %q is in shard %d, not %d", ErrWrongShard, id, want, shard)
	}
	return shard, id, nil
}

// parseShard parses a canonical decimal shard number below n ("7", not "07").
func parseShard(tok string, n int) (int, error) {
	if tok == "" || len(tok) > 6 || (len(tok) > 1 && tok[0] == '0') {
		return 0, fmt.Errorf("shard %q is not a shard number", tok)
	}
	v := 0
	for i := 0; i < len(tok); i++ {
		c := tok[i]
		if c < '0' || c > '9' {
			return 0, fmt.Errorf("shard %q is not a shard number", tok)
		}
		v = v*10 + int(c-'0')
	}
	if v >= n {
		return 0, fmt.Errorf("shard %d is out of range 0..%d", v, n-1)
	}
	return v, nil
}
