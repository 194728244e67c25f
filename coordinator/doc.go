// Package coordinator elects one coordinator per entity type and makes its
// decisions: which region owns which shard.
//
// The decisions live in Core, a deterministic state machine in the style of
// etcd's raft RawNode: Step(event) and Tick() return the actions to carry
// out (fenced table writes, commands to regions, removal of dead regions)
// and nothing in it reads a clock or does I/O. Node is the driver: every
// shardd runs one as a candidate; the candidate that creates the coordinator
// lease in KV leads, with the lease's revision as its epoch. The leader's
// goroutine owns the Core, renews the lease, watches the region registry,
// probes regions over their command subjects and carries out the actions.
// The other candidates probe the leader on its probe subject and depose it
// (a compare-and-delete of its lease) when its connection is gone, rather
// than wait for the lease to expire. With Config.Disconnects (the servers'
// disconnect advisories, DisconnectAdvisories) both the leader and the
// candidates probe at once the owner of a connection that closed.
//
// Safety rests on the server: every shard-table write is fenced on the
// coordinator key's last revision, so a deposed coordinator's writes fail;
// commands are sent only after the writes they depend on succeeded, and
// regions refuse commands from an epoch older than the newest they saw.
package coordinator
