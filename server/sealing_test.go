package server_test

import (
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemcoord/idemcoord/clients"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
)

// sealedConfig is an encryption config with one fresh key.
func sealedConfig(t *testing.T, extra string) string {
	t.Helper()
	k := writeKey(t, t.TempDir(), "k1")
	return "encryption:\n  active_key: k1\n  keys:\n    - { id: k1, file: " + k + " }\n" + extra
}

// queryRow scans the row sql returns into dest.
func queryRow(t *testing.T, url, sql string, dest ...any) error {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return conn.QueryRow(context.Background(), sql).Scan(dest...)
}

// execSQL runs a statement on the coordinator's database, as someone with
// write access to the table would.
func execSQL(t *testing.T, url, sql string, args ...any) {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	tag, err := conn.Exec(context.Background(), sql, args...)
	if err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	if tag.RowsAffected() == 0 {
		t.Fatalf("%s: no row changed", sql)
	}
}

// wholeTable returns every column of every row as PostgreSQL prints it
// (bytea as hex).
func wholeTable(t *testing.T, url string) string {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	rows, err := conn.Query(context.Background(), `SELECT r::text FROM idempotency_records r`)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		out.WriteString(s + "\n")
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out.String()
}

// TestPersonalDataNeverStoredInClear plants a card number and an e-mail
// address everywhere a caller can put text that is not an identity: the
// fingerprint, a handler's error text as failure_reason, the response body
// and metadata. With encryption on none of it may be found in any column
// of the table, in text or in hex; the coordinator still compares
// fingerprints and replays everything exactly.
func TestPersonalDataNeverStoredInClear(t *testing.T) {
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{Config: sealedConfig(t, "")})
	conn := c.Dial(t)
	client := idempotencyv1.NewCoordinatorClient(conn)
	ctx := context.Background()
	const card, mail = "4111111111111111", "ada@example.org"
	planted := []string{card, mail, "4111 1111"}
	fp := []byte("charge " + card + " for " + mail)

	// A failure whose reason is the handler's error text.
	b, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "pay", Key: "failed", Fingerprint: fp})
	if err != nil {
		t.Fatal(err)
	}
	reason := "card 4111 1111 1111 1111 declined: rpc error: code = Unavailable desc = issuer down for " + card + " / " + mail
	if _, err := client.Fail(ctx, &idempotencyv1.FailRequest{Scope: "pay", Key: "failed", LeaseToken: b.GetLeaseToken(),
		Kind: idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN, Reason: reason}); err != nil {
		t.Fatal(err)
	}
	// A replayable failure and a completion, with response metadata.
	resp := &idempotencyv1.StoredResponse{Body: []byte("declined " + card), StatusCode: 402, SchemaVersion: "pay/1",
		ContentType: "text/plain", Metadata: map[string]string{"x-card": card, "x-mail": mail}}
	b, err = client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "pay", Key: "replayable", Fingerprint: fp})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.Fail(ctx, &idempotencyv1.FailRequest{Scope: "pay", Key: "replayable", LeaseToken: b.GetLeaseToken(),
		Kind: idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE, Reason: reason, Response: resp}); err != nil {
		t.Fatal(err)
	}
	b, err = client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "pay", Key: "completed", Fingerprint: fp})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "pay", Key: "completed", LeaseToken: b.GetLeaseToken(),
		Response: resp}); err != nil {
		t.Fatal(err)
	}
	// One still in progress.
	if _, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "pay", Key: "running", Fingerprint: fp}); err != nil {
		t.Fatal(err)
	}

	table := wholeTable(t, c.DatabaseURL)
	for _, p := range append(planted, string(fp)) {
		if strings.Contains(table, p) || strings.Contains(table, hex.EncodeToString([]byte(p))) {
			t.Fatalf("%q is stored in clear:\n%s", p, table)
		}
	}

	// Everything reads back exactly, and fingerprints still compare.
	l, err := client.Lookup(ctx, &idempotencyv1.LookupRequest{Scope: "pay", Key: "failed"})
	if err != nil || l.GetRecord().GetFailureReason() != reason {
		t.Fatalf("failure reason: %v %v", l, err)
	}
	for _, key := range []string{"replayable", "completed"} {
		r, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "pay", Key: key, Fingerprint: fp})
		if err != nil || r.GetOutcome() != replay || !proto.Equal(r.GetRecord().GetResponse(), resp) {
			t.Fatalf("%s: replay: %v %v", key, r, err)
		}
		if bytes.Equal(r.GetRecord().GetFingerprint(), fp) {
			t.Fatalf("%s: the record shows the raw fingerprint", key)
		}
		_, err = client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "pay", Key: key, Fingerprint: []byte("another request")})
		wantCode(t, err, codes.FailedPrecondition, "FINGERPRINT_MISMATCH")
	}
	r, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "pay", Key: "failed", Fingerprint: fp})
	if err != nil || r.GetOutcome() != acquired || r.GetPreviousState() != idempotencyv1.State_STATE_UNKNOWN {
		t.Fatalf("takeover of the UNKNOWN record with the same request: %v %v", r, err)
	}
	// The same request on two keys does not hash alike (no equality leak).
	if a, b := storedFingerprint(t, c.DatabaseURL, "completed"), storedFingerprint(t, c.DatabaseURL, "replayable"); bytes.Equal(a, b) {
		t.Fatal("equal requests of two records have equal stored fingerprints")
	}
}

func storedFingerprint(t *testing.T, url, key string) []byte {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var fp []byte
	if err := conn.QueryRow(context.Background(), `SELECT fingerprint FROM idempotency_records WHERE key = $1`, key).Scan(&fp); err != nil {
		t.Fatal(err)
	}
	return fp
}

// TestTamperedRowsAreNotServed plays a database writer without the keys:
// each change to a sealed row (a clear response column, the state, the
// generation, a ciphertext from an older generation or another row, the
// key id emptied to pass plaintext off as stored in clear) makes the row
// answer DATA_LOSS with RECORD_UNREADABLE, on Begin and on Lookup, never
// its contents; Forget still removes it, and the key is then new.
func TestTamperedRowsAreNotServed(t *testing.T) {
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{Config: sealedConfig(t, "defaults: { ttl: 60s }\n"), FakeClock: true})
	conn := c.Dial(t)
	client, admin := idempotencyv1.NewCoordinatorClient(conn), idempotencyv1.NewAdminClient(conn)
	ctx := context.Background()
	secret := "payment required: card 4111111111111111"
	store := func(key string, fail bool, body string) {
		t.Helper()
		b, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "pay", Key: key})
		if err != nil || b.GetOutcome() != acquired {
			t.Fatalf("%s: %v %v", key, b, err)
		}
		resp := &idempotencyv1.StoredResponse{Body: []byte(body), StatusCode: 402, SchemaVersion: "pay/1", ContentType: "text/plain",
			Metadata: map[string]string{"x": "y"}}
		if fail {
			_, err = client.Fail(ctx, &idempotencyv1.FailRequest{Scope: "pay", Key: key, LeaseToken: b.GetLeaseToken(),
				Kind: idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE, Response: resp, Reason: "declined " + secret})
		} else {
			_, err = client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "pay", Key: key, LeaseToken: b.GetLeaseToken(), Response: resp})
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	unreadable := func(what, key string) {
		t.Helper()
		for name, call := range map[string]func() error{
			"Begin": func() error {
				_, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "pay", Key: key})
				return err
			},
			"Lookup": func() error {
				_, err := client.Lookup(ctx, &idempotencyv1.LookupRequest{Scope: "pay", Key: key})
				return err
			},
		} {
			err := call()
			if status.Code(err) != codes.DataLoss {
				t.Fatalf("%s: %s served a tampered row: %v", what, name, err)
			}
			st := wantCode(t, err, codes.DataLoss, "RECORD_UNREADABLE")
			if strings.Contains(fmt.Sprint(st.Proto()), "4111") || strings.Contains(st.Message(), "payment") {
				t.Fatalf("%s: the error carries the contents: %v", what, st.Proto())
			}
		}
		// Forget works on it, and the key is new afterwards.
		if _, err := admin.Forget(ctx, &idempotencyv1.ForgetRequest{Scope: "pay", Key: key}); err != nil {
			t.Fatalf("%s: Forget: %v", what, err)
		}
		b, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "pay", Key: key})
		if err != nil || b.GetOutcome() != acquired || b.GetPreviousState() != idempotencyv1.State_STATE_UNSPECIFIED {
			t.Fatalf("%s: after Forget: %v %v", what, b, err)
		}
	}

	for _, tc := range []struct {
		name, sql string
		fail      bool
	}{
		{"status_code 402 turned into 200", `UPDATE idempotency_records SET status_code = 200 WHERE key = $1`, false},
		{"schema_version changed", `UPDATE idempotency_records SET schema_version = 'pay/2' WHERE key = $1`, false},
		{"content_type changed", `UPDATE idempotency_records SET content_type = 'application/json' WHERE key = $1`, false},
		{"FAILED_REPLAYABLE turned COMPLETED", `UPDATE idempotency_records SET state = 2, ended_by = 5 WHERE key = $1`, true},
		{"response metadata dropped", `UPDATE idempotency_records SET metadata = NULL WHERE key = $1`, false},
		{"body and metadata swapped", `UPDATE idempotency_records SET body = metadata, metadata = body WHERE key = $1`, false},
		{"response dropped from COMPLETED", `UPDATE idempotency_records SET has_response = false, body = NULL, metadata = NULL WHERE key = $1`, false},
		{"attempt changed", `UPDATE idempotency_records SET attempt = attempt + 1 WHERE key = $1`, false},
		{"generation changed", `UPDATE idempotency_records SET generation = generation + 1 WHERE key = $1`, false},
		{"failure_reason replaced", `UPDATE idempotency_records SET failure_reason = 'c2VjcmV0IGluIGNsZWFy' WHERE key = $1`, true},
		{"failure_reason in clear", `UPDATE idempotency_records SET failure_reason = 'plain text' WHERE key = $1`, true},
		{"key id emptied, body in clear (downgrade)", `UPDATE idempotency_records SET enc_key_id = '', body = 'forged', metadata = NULL, failure_reason = '' WHERE key = $1`, false},
		{"seal_version lowered (downgrade)", `UPDATE idempotency_records SET seal_version = 0 WHERE key = $1`, false},
		{"key id unknown", `UPDATE idempotency_records SET enc_key_id = 'k0' WHERE key = $1`, false},
	} {
		key := strings.ReplaceAll(tc.name, " ", "-")
		store(key, tc.fail, secret)
		execSQL(t, c.DatabaseURL, tc.sql, key)
		unreadable(tc.name, key)
	}

	// A ciphertext moved between rows: the body of another record.
	store("a", false, "for a "+secret)
	store("b", false, "for b")
	// Read, then written: each statement names one key (as Citus needs).
	var bodyOfA []byte
	if err := queryRow(t, c.DatabaseURL, `SELECT body FROM idempotency_records WHERE key = 'a'`, &bodyOfA); err != nil {
		t.Fatal(err)
	}
	execSQL(t, c.DatabaseURL, `UPDATE idempotency_records SET body = $1 WHERE key = 'b'`, bodyOfA)
	unreadable("body copied from another record", "b")

	// An old generation's response moved forward over the new one's.
	store("gen", false, "generation 1 "+secret)
	conn2, err := pgx.Connect(ctx, c.DatabaseURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn2.Close(ctx)
	var oldBody, oldMeta []byte
	if err := conn2.QueryRow(ctx, `SELECT body, metadata FROM idempotency_records WHERE key = 'gen'`).Scan(&oldBody, &oldMeta); err != nil {
		t.Fatal(err)
	}
	c.Clock.Advance(61 * time.Second) // past the 60s ttl: EXPIRED, restart
	b, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "pay", Key: "gen", Ttl: durationpb.New(time.Hour)})
	if err != nil || b.GetRecord().GetGeneration() != 2 {
		t.Fatalf("restart: %v %v", b, err)
	}
	if _, err := client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "pay", Key: "gen", LeaseToken: b.GetLeaseToken(),
		Response: &idempotencyv1.StoredResponse{Body: []byte("generation 2"), StatusCode: 402, SchemaVersion: "pay/1",
			ContentType: "text/plain", Metadata: map[string]string{"x": "y"}}}); err != nil {
		t.Fatal(err)
	}
	execSQL(t, c.DatabaseURL, `UPDATE idempotency_records SET body = $2, metadata = $3 WHERE key = $1`, "gen", oldBody, oldMeta)
	unreadable("an old generation's body moved forward", "gen")

	// The list of an operator still works around an unreadable row.
	store("listed", true, secret)
	execSQL(t, c.DatabaseURL, `UPDATE idempotency_records SET failure_reason = 'AAAA' WHERE key = 'listed'`)
	list, err := admin.ListRecords(ctx, &idempotencyv1.ListRecordsRequest{})
	if err != nil {
		t.Fatalf("ListRecords with an unreadable row: %v", err)
	}
	if strings.Contains(fmt.Sprint(list), "4111") {
		t.Fatalf("ListRecords shows sealed text: %v", list)
	}
}

// failingHealth is a service whose handler fails with personal data in its
// error text, as real handlers do.
type failingHealth struct {
	healthpb.UnimplementedHealthServer
	err error
}

func (h failingHealth) Check(context.Context, *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	return nil, h.err
}

// TestHandlerErrorSealed: a service behind clients.UnaryServerInterceptor
// whose handler fails with a card number and an e-mail address in its
// error text (stored as the failure reason, and the REPLAYABLE status as
// the response) leaves neither readable in any column of the table.
func TestHandlerErrorSealed(t *testing.T) {
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{Config: sealedConfig(t, "")})
	client := clients.New(c.Dial(t))
	const card, mail = "4111111111111111", "ada@example.org"
	for i, code := range []codes.Code{codes.Internal, codes.FailedPrecondition, codes.Unavailable} {
		srv := grpc.NewServer(grpc.ChainUnaryInterceptor(clients.UnaryServerInterceptor(client)))
		healthpb.RegisterHealthServer(srv, failingHealth{err: status.Errorf(code, "charge of card %s for %s declined", card, mail)})
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		go func() { _ = srv.Serve(lis) }()
		t.Cleanup(srv.Stop)
		conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		ctx := metadata.AppendToOutgoingContext(context.Background(), "idempotency-key", fmt.Sprint("order-", i))
		if _, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: "pay " + mail}); status.Code(err) != code {
			t.Fatalf("%v: the handler's error came back as %v", code, err)
		}
	}
	table := wholeTable(t, c.DatabaseURL)
	if strings.Count(table, "\n") != 3 {
		t.Fatalf("want 3 records, table:\n%s", table)
	}
	for _, p := range []string{card, mail, "declined"} {
		if strings.Contains(table, p) || strings.Contains(table, hex.EncodeToString([]byte(p))) {
			t.Fatalf("%q is stored in clear:\n%s", p, table)
		}
	}
	// The coordinator still has the text, for the operator who has the keys.
	l, err := idempotencyv1.NewCoordinatorClient(c.Dial(t)).Lookup(context.Background(),
		&idempotencyv1.LookupRequest{Scope: "/grpc.health.v1.Health/Check", Key: "order-0"})
	if err != nil || !strings.Contains(l.GetRecord().GetFailureReason(), card) {
		t.Fatalf("failure reason through the API: %v %v", l, err)
	}
}

// TestEncryptionBoundToRecord copies one record's sealed body, metadata and
// key id onto another record with SQL: the copy does not decrypt (DATA_LOSS,
// RECORD_UNREADABLE), it is never replayed as the other record's response.
func TestEncryptionBoundToRecord(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	k := writeKey(t, dir, "k")
	c := coordtest.Start(t, coordtest.Options{Config: "encryption:\n  active_key: k\n  keys:\n    - { id: k, file: " + k + " }\n"})
	client := idempotencyv1.NewCoordinatorClient(c.Dial(t))
	store := func(key, body string) {
		t.Helper()
		b, err := client.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "pay", Key: key})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "pay", Key: key, LeaseToken: b.GetLeaseToken(),
			Response: &idempotencyv1.StoredResponse{Body: []byte(body), Metadata: map[string]string{"m": body}}}); err != nil {
			t.Fatal(err)
		}
	}
	store("alice", "alice's receipt")
	store("bob", "bob's receipt")

	conn, err := pgxConnect(c.DatabaseURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var body, metadata []byte
	var keyID string
	if err := conn.QueryRow(context.Background(), `SELECT body, metadata, enc_key_id FROM idempotency_records
		WHERE key = 'alice'`).Scan(&body, &metadata, &keyID); err != nil {
		t.Fatal(err)
	}
	tag, err := conn.Exec(context.Background(), `UPDATE idempotency_records
		SET body = $1, metadata = $2, enc_key_id = $3 WHERE key = 'bob'`, body, metadata, keyID)
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("copying the ciphertext: %v %v", tag, err)
	}
	c.Restart() // no replay cache in the way: the row is read from the table
	client = idempotencyv1.NewCoordinatorClient(c.Dial(t))
	r, err := client.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "pay", Key: "bob"})
	if err == nil {
		t.Fatalf("a ciphertext copied from another record decrypted: %v", r.GetRecord().GetResponse())
	}
	wantCode(t, err, codes.DataLoss, "RECORD_UNREADABLE")
	// The original still replays.
	r, err = client.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "pay", Key: "alice"})
	if err != nil || string(r.GetRecord().GetResponse().GetBody()) != "alice's receipt" {
		t.Fatalf("alice: %v %v", r, err)
	}
}
