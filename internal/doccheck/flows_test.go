package doccheck

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
)

// TestOperatingConfigAndIdemctlFlow loads the operating page's config file
// (the block with its tenants) into a coordinator, leaves records as the
// page's idemctl session expects them (a payment held UNKNOWN by the
// page's policy, an UNKNOWN build, a completed build) as the tenant whose
// token the session exports, runs the session, and checks what it did: so
// a session that needs a tenant that cannot resolve, a key no step made or
// a file no step writes fails.
func TestOperatingConfigAndIdemctlFlow(t *testing.T) {
	var config string
	for _, b := range blocksOn(t, "docs/operating.md", "yaml", "tenants:") {
		config = b.text
	}
	session := blocksOn(t, "docs/operating.md", "sh", "idemctl resolve")[0]
	tokenLine := ""
	for l := range strings.SplitSeq(session.text, "\n") {
		if strings.HasPrefix(l, "export IDEMCOORD_TOKEN=") {
			tokenLine = l
		}
	}
	if tokenLine == "" {
		t.Fatalf("%s: the session does not say whose token it uses (export IDEMCOORD_TOKEN=…)", session)
	}
	tok := strings.Fields(strings.TrimPrefix(tokenLine, "export IDEMCOORD_TOKEN="))[0]

	coord := coordtest.Start(t, coordtest.Options{Config: config})
	api := idempotencyv1.NewCoordinatorClient(coord.Dial(t))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
	begin := func(scope, key string) *idempotencyv1.BeginResponse {
		t.Helper()
		r, err := api.Begin(ctx, &idempotencyv1.BeginRequest{Scope: scope, Key: key})
		if err != nil {
			t.Fatalf("Begin %s %s as the session's tenant: %v", scope, key, err)
		}
		return r
	}
	leaveUnknown := func(scope, key string) {
		t.Helper()
		r := begin(scope, key)
		if _, err := api.Fail(ctx, &idempotencyv1.FailRequest{Scope: scope, Key: key, LeaseToken: r.GetLeaseToken(),
			Kind: idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN}); err != nil {
			t.Fatalf("Fail UNKNOWN %s %s: %v", scope, key, err)
		}
	}
	leaveUnknown("/payments.v1.Payments/Charge", "u1:7c1e5a0e")
	leaveUnknown("build", "order-43")
	r := begin("build", "order-44")
	if _, err := api.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "build", Key: "order-44", LeaseToken: r.GetLeaseToken(),
		Response: &idempotencyv1.StoredResponse{Body: []byte("done")}}); err != nil {
		t.Fatal(err)
	}
	// The page's policy holds the payment: a Begin gets UNKNOWN_HELD until
	// an operator resolves it.
	if r, err := api.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "/payments.v1.Payments/Charge", Key: "u1:7c1e5a0e"}); err == nil && r.GetOutcome() == idempotencyv1.Outcome_OUTCOME_ACQUIRED {
		t.Fatalf("Begin on the payment took it over (%v): the page's policy should hold it for an operator", r.GetPreviousState())
	} else {
		t.Logf("Begin on the held payment: %v %v", r.GetOutcome(), err)
	}

	dir := t.TempDir()
	script := strings.NewReplacer("bin/idemctl", filepath.Join(dir, "idemctl"), "resp.bin", filepath.Join(dir, "resp.bin")).Replace(session.text)
	out, err := runProgram(t, root, []string{"IDEMCOORD_ADDR=" + coord.Addr}, "bash", "-e", "-x", "-c", script)
	if err != nil {
		t.Fatalf("%s: the session failed: %v\n%s", session, err, out)
	}
	if !strings.Contains(out, "u1:7c1e5a0e") {
		t.Errorf("%s: its listings never showed the held payment:\n%s", session, out)
	}

	if r := begin("/payments.v1.Payments/Charge", "u1:7c1e5a0e"); r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY ||
		!strings.Contains(string(r.GetRecord().GetResponse().GetBody()), "charge") {
		t.Errorf("after the session, the payment answers %v %q, want the resolved answer replayed", r.GetOutcome(), r.GetRecord().GetResponse().GetBody())
	}
	if r := begin("build", "order-43"); r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
		t.Errorf("after the session, build order-43 answers %v, want it run again (ACQUIRED)", r.GetOutcome())
	}
	if r := begin("build", "order-44"); r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED || r.GetRecord().GetGeneration() > 1 {
		t.Errorf("after the session, build order-44 answers %v (generation %d), want a new key", r.GetOutcome(), r.GetRecord().GetGeneration())
	}
}
