// Package chaos holds idemcoord's fault tests and the small helpers they
// need. The tests run a real coordinator over a real PostgreSQL and check
// what callers were promised while faults hit: the coordinator process
// killed with SIGKILL under load, PostgreSQL stopped, killed and restarted
// under load, connections between the coordinator and PostgreSQL cut in the
// middle of transactions, the primary of a replicated pair killed and its
// standby promoted, and a linearizability check (porcupine) of per-key
// histories recorded under those faults against a reference model of the
// state table of docs/concepts.md and of the recovery points' rules
// (docs/recovery-points.md), which shares no code with statemachine.
//
// TestRetryingClients drives the demo services of examples/ with real
// third-party retrying clients (go-retryablehttp, grpc-go's service-config
// retryPolicy, Node's axios-retry and Python's requests with urllib3's
// Retry) through toxiproxy, which injects latency, connection resets and
// black holes both between the clients and the demos and between the demos
// and the coordinator, while some calls time out in the middle of Begin.
// Per client it counts side effects per key (exactly one for every key
// answered a success), replays that differ from the first success, and
// keys left held (IN_PROGRESS, UNKNOWN or uncertain) whose handler never
// ran, and prints them on a `chaos: TestRetryingClients: client=…` line.
// It needs ./bin/toxiproxy-server (`make tools`), node with
// chaos/testdata/retryclients/node installed (`npm ci`) and Debian's
// python3-requests; it skips without them, and fails under CI=true. When
// toxiproxy's control API hangs (the upstream bug Shopify/toxiproxy#558),
// the harness kills toxiproxy and starts it again on the same ports, which
// cuts every connection through it, a fault the line's toxiproxy_restart=N
// counts; at most 3 times per run.
//
// The short versions run in `go test ./...`; IDEMCOORD_CHAOS=long (set by
// `make chaos`) runs longer loads with more faults. The Citus tests
// (TestCitus*: a worker killed under load, the reference model on Citus)
// start their own three-node Citus cluster and run only under
// IDEMCOORD_TEST_CITUS=1 (`make test-citus`) or IDEMCOORD_CHAOS=long.
//
// Only test code imports this package. Its one exported helper, Proxy, is a
// TCP forwarder that cuts connections on demand or at random; it imports
// only the standard library. toxiproxy runs as a separate process, driven
// over its HTTP API from test code.
package chaos
