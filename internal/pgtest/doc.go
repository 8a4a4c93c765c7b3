// Package pgtest gives tests real PostgreSQL databases.
//
// A test package hands its schema migration to Main once:
//
//	func TestMain(m *testing.M) { os.Exit(pgtest.Main(m, ledger.Migrate)) }
//
// Main uses the server named by TEST_DATABASE_URL when it is set, and
// otherwise starts one throwaway cluster for the test binary from the
// PostgreSQL server binaries on the machine (PG_BIN, else the newest
// /usr/lib/postgresql/*/bin, else PATH). It migrates a template database
// once; NewDatabase then clones that template for each test, so every test,
// parallel or not, gets its own migrated database in a few milliseconds.
//
// StartCluster starts a separate cluster that a test owns and may stop,
// kill and start again, for fault tests.
//
// Test clusters trade durability for speed (fsync=off and
// full_page_writes=off, and /dev/shm for their files when TMPDIR is unset
// and it has 1 GiB free) unless ClusterOptions.Durable is set, listen on
// 127.0.0.1 only and trust every local connection: they are for tests,
// never for data that matters. synchronous_commit stays on, so a test that
// kills PostgreSQL's processes (not the machine) keeps every commit
// PostgreSQL acknowledged.
//
// The processes pgtest starts (PostgreSQL's postmaster, PgBouncer) end with
// the test binary however it ends, a SIGKILL included: on Linux each is its
// direct child with a parent-death signal. If the test binary dies without
// cleaning up, a watchdog process also stops its clusters (where there is
// no parent-death signal) and deletes their files. When the process runs as
// root, the server programs run as the "postgres" system user, switched to
// as they start. StartTied ties a process a test starts itself (a
// coordinator binary, through coordtest.StartTied) to the test binary the
// same way.
//
// pgtest is imported by tests and by the benchmark driver (bench/, through
// Launch, for a durable cluster). It imports pgx and the standard library,
// never idemcoord's own packages: the migration is passed in.
package pgtest
