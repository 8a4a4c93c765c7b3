package server_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
)

// TestDatabaseOutage stops PostgreSQL under a running coordinator: health
// goes NOT_SERVING, calls fail UNAVAILABLE within their deadline, and both
// recover by themselves when the database is back.
func TestDatabaseOutage(t *testing.T) {
	t.Parallel()
	cluster := pgtest.StartCluster(t, pgtest.ClusterOptions{})
	url := cluster.URL("postgres")
	if err := ledger.Migrate(context.Background(), url); err != nil {
		t.Fatal(err)
	}
	c := coordtest.Start(t, coordtest.Options{DatabaseURL: url})
	conn := c.Dial(t)
	health := healthpb.NewHealthClient(conn)
	client := idempotencyv1.NewCoordinatorClient(conn)

	waitHealth := func(want healthpb.HealthCheckResponse_ServingStatus) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			r, err := health.Check(ctx(t), &healthpb.HealthCheckRequest{Service: "idempotency.v1.Coordinator"})
			if err == nil && r.GetStatus() == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("health never became %v (last: %v, %v)", want, r.GetStatus(), err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	begin := func(key string) error {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := client.Begin(cctx, &idempotencyv1.BeginRequest{Scope: "s", Key: key})
		return err
	}

	waitHealth(healthpb.HealthCheckResponse_SERVING)
	if code := readyz(c); code != http.StatusOK {
		t.Fatalf("/readyz before the outage = %d, want 200", code)
	}
	if err := begin("before"); err != nil {
		t.Fatal(err)
	}
	if err := cluster.Stop(); err != nil {
		t.Fatal(err)
	}
	waitHealth(healthpb.HealthCheckResponse_NOT_SERVING)
	if code := readyz(c); code != http.StatusServiceUnavailable {
		t.Fatalf("/readyz during the outage = %d, want 503", code)
	}
	for _, key := range []string{"before", "during"} {
		start := time.Now()
		err := begin(key)
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("Begin while the database is down: %v, want UNAVAILABLE", err)
		}
		if el := time.Since(start); el > 5*time.Second {
			t.Fatalf("Begin took %v past its deadline", el)
		}
	}
	if err := cluster.Start(); err != nil {
		t.Fatal(err)
	}
	waitHealth(healthpb.HealthCheckResponse_SERVING)
	if code := readyz(c); code != http.StatusOK {
		t.Fatalf("/readyz after the outage = %d, want 200", code)
	}
	if err := begin("after"); err != nil {
		t.Fatal(err)
	}
	r, err := client.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "s", Key: "before"})
	if err != nil || r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_IN_PROGRESS {
		t.Fatalf("record written before the outage: %v, %v", r, err)
	}
}

// readyz is the status code of the coordinator's /readyz.
func readyz(c *coordtest.Coordinator) int {
	rec := httptest.NewRecorder()
	c.Server.HTTPHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
	return rec.Code
}
