package protocol

import "errors"

// Errors returned by this package. Wrapped errors name the offending value;
// test for the kind with errors.Is.
var (
	// ErrInvalidName: a type, region id or prefix that is not a valid name.
	ErrInvalidName = errors.New("protocol: invalid name")
	// ErrInvalidEntityID: an entity id that is empty, too long or not made
	// of valid subject tokens.
	ErrInvalidEntityID = errors.New("protocol: invalid entity id")
	// ErrInvalidSubject: a subject that is not a data subject of this type.
	ErrInvalidSubject = errors.New("protocol: invalid subject")
	// ErrWrongShard: the shard token does not match the entity id's shard.
	ErrWrongShard = errors.New("protocol: entity id does not belong to shard")
	// ErrMalformed: a control message or KV value that does not decode.
	ErrMalformed = errors.New("protocol: malformed message")
)
