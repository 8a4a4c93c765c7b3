// Package chaos holds idemcoord's fault tests and the small helpers they
// need. The tests run a real coordinator over a real PostgreSQL and check
// what callers were promised while faults hit: the coordinator process
// killed with SIGKILL under load, PostgreSQL stopped, killed and restarted
// under load, connections between the coordinator and PostgreSQL cut in the
// middle of transactions, the primary of a replicated pair killed and its
// standby promoted, and a linearizability check (porcupine) of per-key
// histories recorded under those faults against a reference model of the
// state table written from DESIGN.md, which shares no code with
// statemachine.
//
// The short versions run in `go test ./...`; IDEMCOORD_CHAOS=long (set by
// `make chaos`) runs longer loads with more faults.
//
// Only test code imports this package. Its one exported helper, Proxy, is a
// TCP forwarder that cuts connections on demand or at random; it imports
// only the standard library.
package chaos
