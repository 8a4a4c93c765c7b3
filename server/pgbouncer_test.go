package server_test

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/idemcoord/idemcoord/internal/coordtest"
)

// contractTests are the behaviour tests run again through PgBouncer:
// acquisition, replay, races, waits (woken by notifications or by
// polling), every ending call, leases, the admin service, tenants,
// encryption, validation and a read-only database. `make test-pgbouncer`
// runs the whole package that way.
var contractTests = []string{
	"TestNewKeyAcquiresAndHeldKeyIsInProgress", "TestCompleteThenReplayByteForByte", "TestConcurrentBeginsOneWinner",
	"TestSameAttemptIDGetsSameToken", "TestWaitWakesWhenHolderCompletes", "TestWaitWakesAtLeaseExpiry",
	"TestWaitRunsOutAnswersInProgress", "TestFailKinds", "TestRepeatedEndingCalls", "TestHeartbeatExtendsLease",
	"TestLeaseExpiryMakesUnknownAndTakeover", "TestUnknownHeldUnderHoldPolicy", "TestAdminResolveCompleted",
	"TestAdminForget", "TestAdminListRecords", "TestTenantsAreIsolated", "TestEncryptionAtRestAndRotation",
	"TestInvalidArgumentsWriteNothing", "TestReadOnlyDatabaseAnswersUnavailable", "TestConcurrentPairsAndRepeats",
}

// TestContractThroughPgBouncer runs contractTests again, in a child test
// process, with every coordinator connected through a PgBouncer in
// transaction pooling mode (coordtest.PgBouncerEnv): once with the LISTEN
// connection direct (--notify-database-url) and once with notifications
// off (--notifications=off: no replay cache, waits poll).
func TestContractThroughPgBouncer(t *testing.T) {
	if os.Getenv(coordtest.PgBouncerEnv) != "" {
		t.Skip("already running through PgBouncer")
	}
	if _, err := exec.LookPath("pgbouncer"); err != nil {
		if _, err := os.Stat("/usr/sbin/pgbouncer"); err != nil {
			t.Skip("no pgbouncer installed (Debian: apt-get install pgbouncer; .ci/run installs it)")
		}
	}
	for _, mode := range []string{"listen", "poll"} {
		t.Run(mode, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run", "^("+strings.Join(contractTests, "|")+")$", "-test.count=1", "-test.v")
			cmd.Env = append(os.Environ(), coordtest.PgBouncerEnv+"="+mode)
			out, err := cmd.CombinedOutput()
			passed := strings.Count(string(out), "--- PASS: ")
			if err != nil || passed != len(contractTests) {
				t.Fatalf("the contract tests through PgBouncer (%s): %v; %d of %d passed:\n%s", mode, err, passed, len(contractTests), out)
			}
			t.Logf("%d contract tests passed through PgBouncer in transaction pooling mode (notifications: %s)", passed, mode)
		})
	}
}
