package server_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/testkit"
	"github.com/idemcoord/idemcoord/server"
)

// The fuzz targets send arbitrary bytes, as the serialized request, to the
// real server over gRPC and require that it never panics, never answers
// INTERNAL (or anything but OK, INVALID_ARGUMENT, FAILED_PRECONDITION and
// NOT_FOUND), and that a call answered INVALID_ARGUMENT writes nothing. In
// "live" mode (odd mode byte) the request is first pointed at a record
// just acquired, with its lease token, so that valid-looking input reaches
// the state machine and the database; a call accepted there must store
// exactly what it sent.
//
// Short run of each, as CI does (see `make fuzz-short`):
//
//	go test ./server -run '^$' -fuzz '^FuzzBegin$' -fuzztime 10s

func FuzzBegin(f *testing.F) {
	for _, r := range []*idempotencyv1.BeginRequest{
		{Scope: "s", Key: "k"},
		{Scope: "s", Key: "k", Fingerprint: []byte("fp"), AttemptId: "a1", Ttl: dur(time.Minute), Lease: dur(time.Second), Wait: dur(0)},
		{Scope: "", Key: "k"},
		{Scope: "s", Key: ""},
		{Scope: strings.Repeat("s", 256), Key: "k"},
		{Scope: "s", Key: strings.Repeat("é", 128)},
		{Scope: "s", Key: "k\x00"},
		{Scope: "s", Key: "k\u0085"},
		{Scope: "s", Key: "k\u200b🙂"},
		{Scope: "s", Key: "k", Fingerprint: bytes.Repeat([]byte{1}, 65)},
		{Scope: "s", Key: "k", Ttl: dur(0)},
		{Scope: "s", Key: "k", Ttl: dur(-time.Second)},
		{Scope: "s", Key: "k", Ttl: dur(721 * time.Hour)},
		{Scope: "s", Key: "k", Ttl: dur(time.Nanosecond)},
		{Scope: "s", Key: "k", Ttl: &durationpb.Duration{Seconds: 1, Nanos: 1_000_000_000}},
		{Scope: "s", Key: "k", Ttl: &durationpb.Duration{Seconds: 1 << 62}},
		{Scope: "s", Key: "k", Lease: dur(999 * time.Millisecond)},
		{Scope: "s", Key: "k", Lease: &durationpb.Duration{Seconds: 144, Nanos: 1}}, // once failed: stored 144 s
		{Scope: "s", Key: "k", Lease: dur(time.Hour + time.Nanosecond)},
		{Scope: "s", Key: "k", Lease: &durationpb.Duration{Seconds: -1, Nanos: 5}},
		{Scope: "s", Key: "k", Wait: dur(31 * time.Second)},
		{Scope: "s", Key: "k", Wait: dur(-time.Millisecond)},
		{Scope: "s", Key: "k", AcceptSchemaVersions: make([]string, 33)},
		{Scope: "s", Key: "k", AcceptSchemaVersions: []string{strings.Repeat("v", 256)}},
		{Scope: "s", Key: "k", AcceptSchemaVersions: []string{"v1", "\x01"}},
		{Scope: "s", Key: "k", AttemptId: strings.Repeat("a", 65)},
		{Scope: "s", Key: "k", AttemptId: "a\n"},
	} {
		f.Add(marshal(f, r), uint8(0))
	}
	f.Add(withUnknownField(marshal(f, &idempotencyv1.BeginRequest{Scope: "s", Key: "u"})), uint8(0))
	f.Add([]byte("\x0a\x01s\x12\x02\xff\xfe"), uint8(0)) // key is not UTF-8
	f.Add([]byte{0x0a, 0x05, 's'}, uint8(0))             // truncated
	fuzzCall(f, fuzzMethod{
		name:     "Begin",
		req:      func() proto.Message { return &idempotencyv1.BeginRequest{} },
		answered: checkAcquired,
	})
}

func FuzzComplete(f *testing.F) {
	for _, r := range []*idempotencyv1.CompleteRequest{
		{Scope: "s", Key: "k", LeaseToken: "t"},
		{Scope: "s", Key: "k", LeaseToken: "t", Response: &idempotencyv1.StoredResponse{}},
		{Scope: "s", Key: "k", LeaseToken: "t", Response: &idempotencyv1.StoredResponse{SchemaVersion: "v1", ContentType: "application/json",
			Body: []byte(`{"ok":true}`), StatusCode: 201, Metadata: map[string]string{"location": "/x", "": "\x00", "k\n": "🙂"}}},
		{Scope: "s", Key: "k", LeaseToken: ""},
		{Scope: "s", Key: "k", LeaseToken: strings.Repeat("t", 129)},
		{Scope: "s", Key: "k", LeaseToken: "t\x00"}, // once answered INTERNAL: NUL reached SQL
		{Scope: "", Key: "k", LeaseToken: "t"},
		{Scope: "s", Key: "k\x7f", LeaseToken: "t"},
		{Scope: "s", Key: "k", LeaseToken: "t", Response: &idempotencyv1.StoredResponse{SchemaVersion: "v\x01"}},
		{Scope: "s", Key: "k", LeaseToken: "t", Response: &idempotencyv1.StoredResponse{ContentType: "text/plain\r\n"}},
		{Scope: "s", Key: "k", LeaseToken: "t", Response: &idempotencyv1.StoredResponse{StatusCode: -1 << 31}},
		{Scope: "s", Key: "k", LeaseToken: "t", Response: &idempotencyv1.StoredResponse{Body: make([]byte, 1<<20)}},
	} {
		f.Add(marshal(f, r), uint8(0))
		f.Add(marshal(f, r), uint8(1))
	}
	f.Add([]byte("\x0a\x01s\x12\x01k\x1a\x01t\x22\x03\x1a\x01\xff"), uint8(1))
	fuzzCall(f, fuzzMethod{
		name: "Complete",
		req:  func() proto.Message { return &idempotencyv1.CompleteRequest{} },
		point: func(m proto.Message, scope, key, token string) {
			r := m.(*idempotencyv1.CompleteRequest)
			r.Scope, r.Key, r.LeaseToken = scope, key, token
		},
		accepted: func(t *testing.T, e *testEnv, m proto.Message, scope, key string) {
			want := withoutUnknownFields(t, m.(*idempotencyv1.CompleteRequest).GetResponse())
			rec := fuzzLookup(t, e, scope, key)
			if rec.GetState() != idempotencyv1.State_STATE_COMPLETED || !proto.Equal(rec.GetResponse(), want) {
				t.Fatalf("accepted Complete stored %v, want COMPLETED with %v", rec, want)
			}
		},
	})
}

func FuzzFail(f *testing.F) {
	resp := &idempotencyv1.StoredResponse{SchemaVersion: "v1", Body: []byte("no"), StatusCode: 409, Metadata: map[string]string{"a": "b"}}
	for _, r := range []*idempotencyv1.FailRequest{
		{Scope: "s", Key: "k", LeaseToken: "t", Kind: idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE},
		{Scope: "s", Key: "k", LeaseToken: "t", Kind: idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE, Response: resp, Reason: "conflict"},
		{Scope: "s", Key: "k", LeaseToken: "t", Kind: idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE},
		{Scope: "s", Key: "k", LeaseToken: "t", Kind: idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN, Reason: "timeout\nafter 3s"},
		{Scope: "s", Key: "k", LeaseToken: "t", Kind: idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED},
		{Scope: "s", Key: "k", LeaseToken: "t", Kind: idempotencyv1.FailureKind_FAILURE_KIND_UNSPECIFIED},
		{Scope: "s", Key: "k", LeaseToken: "t", Kind: 5},
		{Scope: "s", Key: "k", LeaseToken: "t", Kind: -1},
		{Scope: "s", Key: "k", LeaseToken: "t", Kind: idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE, Reason: strings.Repeat("r", 1025)},
		{Scope: "s", Key: "k", LeaseToken: "t", Kind: idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE, Reason: "r\x00"},
		{Scope: "s", Key: "k", LeaseToken: "t", Kind: idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE, Reason: "r\x01\x1b[31m"},
		{Scope: "s", Key: "k", LeaseToken: "t", Kind: idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE, Response: resp},
		{Scope: "s", Key: "k", LeaseToken: "t\x00", Kind: idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE},
	} {
		f.Add(marshal(f, r), uint8(0))
		f.Add(marshal(f, r), uint8(1))
	}
	fuzzCall(f, fuzzMethod{
		name: "Fail",
		req:  func() proto.Message { return &idempotencyv1.FailRequest{} },
		point: func(m proto.Message, scope, key, token string) {
			r := m.(*idempotencyv1.FailRequest)
			r.Scope, r.Key, r.LeaseToken = scope, key, token
		},
		accepted: func(t *testing.T, e *testEnv, m proto.Message, scope, key string) {
			req := m.(*idempotencyv1.FailRequest)
			if req.GetKind() == idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED {
				// The first attempt abandoned: the record is gone.
				if _, err := e.client.Lookup(ctx(t), &idempotencyv1.LookupRequest{Scope: scope, Key: key}); status.Code(err) != codes.NotFound {
					t.Fatalf("abandoned first attempt: Lookup = %v, want NOT_FOUND", err)
				}
				return
			}
			want := map[idempotencyv1.FailureKind]idempotencyv1.State{
				idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE:  idempotencyv1.State_STATE_FAILED_RETRYABLE,
				idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE: idempotencyv1.State_STATE_FAILED_REPLAYABLE,
				idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN:    idempotencyv1.State_STATE_UNKNOWN,
			}[req.GetKind()]
			rec := fuzzLookup(t, e, scope, key)
			if rec.GetState() != want || rec.GetFailureReason() != req.GetReason() {
				t.Fatalf("accepted Fail %v stored %v", req.GetKind(), rec)
			}
			if want == idempotencyv1.State_STATE_FAILED_REPLAYABLE && !proto.Equal(rec.GetResponse(), withoutUnknownFields(t, req.GetResponse())) {
				t.Fatalf("accepted Fail REPLAYABLE stored response %v, want %v", rec.GetResponse(), req.GetResponse())
			}
		},
	})
}

// FuzzBatch sends arbitrary bytes as a BatchRequest: besides what every
// target requires of the RPC, each call's own error must be one a unary
// call may answer (DEADLINE_EXCEEDED too: a call's timeout), an
// INVALID_ARGUMENT with a field violation, and there is one result per
// call.
func FuzzBatch(f *testing.F) {
	begin := func(r *idempotencyv1.BeginRequest) *idempotencyv1.BatchCall {
		return &idempotencyv1.BatchCall{Call: &idempotencyv1.BatchCall_Begin{Begin: r}}
	}
	lookup := &idempotencyv1.BatchCall{Call: &idempotencyv1.BatchCall_Lookup{Lookup: &idempotencyv1.LookupRequest{Scope: "s", Key: "k"}}}
	complete := &idempotencyv1.BatchCall{Call: &idempotencyv1.BatchCall_Complete{Complete: &idempotencyv1.CompleteRequest{Scope: "s", Key: "k", LeaseToken: "t"}}}
	timed := func(c *idempotencyv1.BatchCall, d *durationpb.Duration) *idempotencyv1.BatchCall {
		return &idempotencyv1.BatchCall{Call: c.GetCall(), Timeout: d}
	}
	for _, r := range []*idempotencyv1.BatchRequest{
		{},
		{Calls: []*idempotencyv1.BatchCall{begin(&idempotencyv1.BeginRequest{Scope: "s", Key: "k"}), lookup, complete}},
		{Calls: []*idempotencyv1.BatchCall{begin(&idempotencyv1.BeginRequest{Scope: "s", Key: "k"}), begin(&idempotencyv1.BeginRequest{Scope: "s", Key: "k"})}},
		{Calls: []*idempotencyv1.BatchCall{begin(&idempotencyv1.BeginRequest{Scope: "s", Key: ""}), lookup}},
		{Calls: []*idempotencyv1.BatchCall{begin(&idempotencyv1.BeginRequest{Scope: "s", Key: "w", Wait: dur(time.Second)})}},
		{Calls: []*idempotencyv1.BatchCall{timed(lookup, dur(0)), timed(lookup, dur(time.Nanosecond)), timed(lookup, &durationpb.Duration{Seconds: 1 << 62})}},
		{Calls: []*idempotencyv1.BatchCall{lookup, {}}},
	} {
		f.Add(marshal(f, r), uint8(0))
	}
	f.Add([]byte("\x0a\x09\x0a\x07\x0a\x01s\x12\x02\xff\xfe"), uint8(0)) // calls[0].begin.key is not UTF-8
	fuzzCall(f, fuzzMethod{
		name:     "Batch",
		req:      func() proto.Message { return &idempotencyv1.BatchRequest{} },
		answered: checkBatchResults,
	})
}

// checkBatchResults checks the results of a Batch that answered OK.
func checkBatchResults(t *testing.T, _ *testEnv, m proto.Message, out []byte) {
	t.Helper()
	req := m.(*idempotencyv1.BatchRequest)
	var resp idempotencyv1.BatchResponse
	if err := proto.Unmarshal(out, &resp); err != nil {
		t.Fatalf("Batch answered undecodable bytes %q: %v", out, err)
	}
	if len(resp.GetResults()) != len(req.GetCalls()) {
		t.Fatalf("Batch of %d calls answered %d results", len(req.GetCalls()), len(resp.GetResults()))
	}
	for i, r := range resp.GetResults() {
		if r.GetResult() == nil {
			t.Fatalf("result %d is empty", i)
		}
		if r.GetError() == nil {
			continue
		}
		st := status.FromProto(r.GetError())
		switch st.Code() {
		case codes.FailedPrecondition, codes.NotFound, codes.DeadlineExceeded:
		case codes.InvalidArgument:
			if !hasFieldViolation(st) {
				t.Fatalf("call %d answered INVALID_ARGUMENT without a BadRequest field violation: %v", i, st.Err())
			}
		default:
			t.Fatalf("call %d answered %v: %v; call %v", i, st.Code(), st.Err(), req.GetCalls()[i])
		}
	}
}

// checkAcquired looks up the record an accepted Begin acquired: it must be
// stored IN_PROGRESS with the request's fingerprint (if it has one) and a lease of the
// request's length (the policy's 30 s without one) from now, rounded up to
// the microsecond, exactly as the Begin answered it.
func checkAcquired(t *testing.T, e *testEnv, m proto.Message, out []byte) {
	t.Helper()
	req := m.(*idempotencyv1.BeginRequest)
	var resp idempotencyv1.BeginResponse
	if err := proto.Unmarshal(out, &resp); err != nil {
		t.Fatalf("Begin answered undecodable bytes %q: %v", out, err)
	}
	if resp.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
		return
	}
	rec := fuzzLookup(t, e, req.GetScope(), req.GetKey())
	lease := 30 * time.Second
	if req.GetLease() != nil {
		lease = req.GetLease().AsDuration()
	}
	if r := lease % time.Microsecond; r > 0 {
		lease += time.Microsecond - r
	}
	// A request without a fingerprint matches any; one with must be stored.
	if rec.GetState() != idempotencyv1.State_STATE_IN_PROGRESS ||
		(len(req.GetFingerprint()) > 0 && !bytes.Equal(rec.GetFingerprint(), req.GetFingerprint())) ||
		!rec.GetLeaseExpiresAt().AsTime().Equal(e.clock.Now().Add(lease)) || resp.GetLeaseToken() == "" {
		t.Fatalf("accepted Begin %v stored %v (token %q)", req, rec, resp.GetLeaseToken())
	}
	if !proto.Equal(rec, resp.GetRecord()) {
		t.Fatalf("accepted Begin answered record %v, Lookup reads %v", resp.GetRecord(), rec)
	}
}

// fuzzMethod describes one RPC for fuzzCall.
type fuzzMethod struct {
	name string
	req  func() proto.Message
	// point aims a decoded request at a live record (nil: the method needs
	// no lease token).
	point func(req proto.Message, scope, key, token string)
	// accepted checks the stored record after a live call answered OK.
	accepted func(t *testing.T, e *testEnv, req proto.Message, scope, key string)
	// answered checks what any call that answered OK stored, given the
	// decoded request and the raw response.
	answered func(t *testing.T, e *testEnv, req proto.Message, resp []byte)
}

// fuzzCall runs the fuzz loop of m against one coordinator. Its clock jumps
// two hours before every call, so no lease from an earlier input is still
// held and a Begin's wait never has anything to wait for.
func fuzzCall(f *testing.F, m fuzzMethod) {
	// The coordinator logs to logs, not to f: a fuzz target may not call
	// f.Logf. An ERROR record there means a call went wrong.
	logs := &testkit.LogBuffer{} // from logging_test.go
	logger := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelError}))
	c := coordtest.Start(f, coordtest.Options{FakeClock: true, ServerOptions: []server.Option{server.WithLogger(logger)}})
	conn := c.Dial(f)
	client := idempotencyv1.NewCoordinatorClient(conn)
	db, err := pgx.Connect(context.Background(), c.DatabaseURL)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = db.Close(context.Background()) })
	var live atomic.Int64

	f.Fuzz(func(t *testing.T, data []byte, mode uint8) {
		e := &testEnv{t: t, coord: c, clock: c.Clock, dbURL: c.DatabaseURL, client: client}
		c.Clock.Advance(2 * time.Hour)
		req := m.req()
		decodes := proto.Unmarshal(data, req) == nil
		var scope, key string
		if decodes && mode%2 == 1 && m.point != nil {
			// Aim the request at a record acquired just now.
			scope, key = "live", fmt.Sprintf("k%d", live.Add(1))
			b, err := client.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: scope, Key: key})
			if err != nil {
				t.Fatal(err)
			}
			m.point(req, scope, key, b.GetLeaseToken())
			if data, err = proto.Marshal(req); err != nil {
				t.Fatal(err)
			}
		}

		before := tableVersion(t, db)
		logged := len(logs.String())
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		var out []byte
		err := conn.Invoke(cctx, "/idempotency.v1.Coordinator/"+m.name, &data, &out, grpc.ForceCodecV2(rawCodec{}))
		st := status.Convert(err)
		switch st.Code() {
		case codes.OK, codes.FailedPrecondition, codes.NotFound:
		case codes.InvalidArgument:
			if after := tableVersion(t, db); after != before {
				t.Fatalf("%s answered %v yet wrote: table %s before, %s after; request %v", m.name, err, before, after, req)
			}
			if !hasFieldViolation(st) {
				t.Fatalf("%s answered INVALID_ARGUMENT without a BadRequest field violation: %v", m.name, err)
			}
		default: // INTERNAL (a panic included), UNKNOWN, UNAVAILABLE, …
			t.Fatalf("%s answered %v: %v; request %v (raw %q); server log: %s", m.name, st.Code(), err, req, data, logs.String()[logged:])
		}
		if l := logs.String()[logged:]; l != "" {
			t.Fatalf("%s logged an error (answer %v): %s; request %v (raw %q)", m.name, err, l, req, data)
		}
		if err == nil && m.answered != nil {
			m.answered(t, e, req, out)
		}
		if err == nil && key != "" && m.accepted != nil {
			m.accepted(t, e, req, scope, key)
		}
	})
}

// withoutUnknownFields returns r as stored: fields the schema does not
// define are not kept, and an absent response is stored as an empty one.
func withoutUnknownFields(t *testing.T, r *idempotencyv1.StoredResponse) *idempotencyv1.StoredResponse {
	t.Helper()
	b, err := proto.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	out := &idempotencyv1.StoredResponse{}
	if err := (proto.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(b, out); err != nil {
		t.Fatal(err)
	}
	return out
}

// tableVersion changes whenever a row is inserted, updated or deleted: the
// row count and the newest row version's transaction id.
func tableVersion(t *testing.T, db *pgx.Conn) string {
	t.Helper()
	var n, xmin int64
	if err := db.QueryRow(context.Background(), `SELECT count(*), coalesce(max(xmin::text::bigint), 0)
		FROM idempotency_records`).Scan(&n, &xmin); err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("rows=%d xmin=%d", n, xmin)
}

func hasFieldViolation(st *status.Status) bool {
	for _, d := range st.Details() {
		if br, ok := d.(*errdetails.BadRequest); ok && len(br.GetFieldViolations()) > 0 {
			return true
		}
	}
	return false
}

func fuzzLookup(t *testing.T, e *testEnv, scope, key string) *idempotencyv1.Record {
	t.Helper()
	r, err := e.client.Lookup(ctx(t), &idempotencyv1.LookupRequest{Scope: scope, Key: key})
	if err != nil {
		t.Fatalf("Lookup after an accepted call: %v", err)
	}
	return r.GetRecord()
}

func dur(d time.Duration) *durationpb.Duration { return durationpb.New(d) }

func marshal(f *testing.F, m proto.Message) []byte {
	b, err := proto.Marshal(m)
	if err != nil {
		f.Fatal(err)
	}
	return b
}

// withUnknownField appends field 99 (a varint) that no request defines.
func withUnknownField(b []byte) []byte {
	b = protowire.AppendTag(b, 99, protowire.VarintType)
	return protowire.AppendVarint(b, 7)
}
