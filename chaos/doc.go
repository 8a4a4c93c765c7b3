// Package chaos holds idemcoord's fault tests and the small helpers they
// need. The tests run a real coordinator over a real PostgreSQL and check
// what callers were promised while faults hit: the coordinator process
// killed with SIGKILL under load, PostgreSQL stopped, killed and restarted
// under load, connections between the coordinator and PostgreSQL cut in the
// middle of transactions, and a linearizability check (porcupine, with a
// model built on statemachine.Next) of per-key histories recorded under
// those faults.
//
// The short versions run in `go test ./...`; IDEMCOORD_CHAOS=long (set by
// `make chaos`) runs longer loads with more faults.
//
// Only test code imports this package. Its one exported helper, Proxy, is a
// TCP forwarder that cuts connections on demand or at random; it imports
// only the standard library.
package chaos
