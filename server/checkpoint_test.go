package server_test

import (
	"bytes"
	"context"
	"encoding/hex"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
)

const (
	acq          = idempotencyv1.Outcome_OUTCOME_ACQUIRED
	prevUnknown  = idempotencyv1.State_STATE_UNKNOWN
	prevRetry    = idempotencyv1.State_STATE_FAILED_RETRYABLE
	reasonCkpt   = "CHECKPOINT_RECORDED"
	reasonLost   = "LEASE_LOST"
	policyLease  = 30 * time.Second // the default policy's lease
	policyTTL    = 24 * time.Hour
	checkpointed = "reserved"
)

// heartbeat records phase/data with the holder's token.
func (e *testEnv) heartbeat(scope, key, token, phase string, data []byte) (*idempotencyv1.HeartbeatResponse, error) {
	return e.client.Heartbeat(ctx(e.t), &idempotencyv1.HeartbeatRequest{Scope: scope, Key: key, LeaseToken: token,
		Checkpoint: &idempotencyv1.Checkpoint{Phase: phase, Data: data}})
}

// beginCheckpointed acquires s/k and records the checkpoint checkpointed,
// "r_1"; it returns the acquisition and the checkpoint's time.
func (e *testEnv) beginCheckpointed() (*idempotencyv1.BeginResponse, time.Time) {
	e.t.Helper()
	b := e.mustBegin("s", "k", acq)
	at := e.clock.Now()
	if _, err := e.heartbeat("s", "k", b.GetLeaseToken(), checkpointed, []byte("r_1")); err != nil {
		e.t.Fatal(err)
	}
	return b, at
}

// wantCheckpoint fails unless rec carries exactly phase and data, recorded
// at `at`.
func wantCheckpoint(t *testing.T, what string, rec *idempotencyv1.Record, phase string, data []byte, at time.Time) {
	t.Helper()
	c := rec.GetCheckpoint()
	if c == nil || c.GetPhase() != phase || !bytes.Equal(c.GetData(), data) || !c.GetAt().AsTime().Equal(at) {
		t.Fatalf("%s: checkpoint %v, want phase %q data %q at %v", what, c, phase, data, at)
	}
}

// TestCheckpointRecordedAndRead: a Heartbeat with a checkpoint records it
// (at the coordinator's time, whatever `at` the request says) and extends
// the lease; Lookup and the Heartbeat's answer show it, a second one
// replaces it, and idempotency_checkpoints_total counts them.
func TestCheckpointRecordedAndRead(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	b := e.mustBegin("s", "k", acq)
	if b.GetRecord().GetCheckpoint() != nil {
		t.Fatalf("a new key has checkpoint %v", b.GetRecord().GetCheckpoint())
	}
	e.clock.Advance(10 * time.Second)
	at := e.clock.Now()
	hb, err := e.client.Heartbeat(ctx(t), &idempotencyv1.HeartbeatRequest{Scope: "s", Key: "k", LeaseToken: b.GetLeaseToken(),
		Checkpoint: &idempotencyv1.Checkpoint{Phase: checkpointed, Data: []byte("ch_1"), At: b.GetRecord().GetCreatedAt()}})
	if err != nil {
		t.Fatal(err)
	}
	wantCheckpoint(t, "Heartbeat answer", hb.GetRecord(), checkpointed, []byte("ch_1"), at)
	if got := hb.GetRecord().GetLeaseExpiresAt().AsTime(); !got.Equal(at.Add(policyLease)) {
		t.Fatalf("lease expires %v, want %v (extended by the Heartbeat)", got, at.Add(policyLease))
	}
	wantCheckpoint(t, "Lookup", e.mustLookup("s", "k"), checkpointed, []byte("ch_1"), at)

	e.clock.Advance(time.Second)
	if _, err := e.heartbeat("s", "k", b.GetLeaseToken(), "charged", nil); err != nil {
		t.Fatal(err)
	}
	wantCheckpoint(t, "second checkpoint", e.mustLookup("s", "k"), "charged", nil, e.clock.Now())
	// A Heartbeat without one keeps it.
	if _, err := e.client.Heartbeat(ctx(t), &idempotencyv1.HeartbeatRequest{Scope: "s", Key: "k", LeaseToken: b.GetLeaseToken()}); err != nil {
		t.Fatal(err)
	}
	wantCheckpoint(t, "after a plain Heartbeat", e.mustLookup("s", "k"), "charged", nil, e.clock.Now())

	if got := e.metric("idempotency_checkpoints_total{"); got != `idempotency_checkpoints_total{scope="other"} 2` {
		t.Fatalf("/metrics: %q, want 2 checkpoints (of a scope the policy file does not name)", got)
	}
}

// TestCheckpointFenced: once another attempt took the key over, the
// vanished holder's Heartbeat with a checkpoint fails LEASE_LOST and
// changes nothing; the takeover found the checkpoint the first attempt
// recorded before its lease lapsed, and the lapse still reads UNKNOWN.
func TestCheckpointFenced(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	first, at := e.beginCheckpointed()
	e.clock.Advance(policyLease + time.Second)
	if got := e.mustLookup("s", "k"); got.GetState() != idempotencyv1.State_STATE_UNKNOWN {
		t.Fatalf("lapsed lease after a checkpoint reads %v, want UNKNOWN", got.GetState())
	}
	second := e.mustBegin("s", "k", acq)
	if second.GetPreviousState() != prevUnknown {
		t.Fatalf("takeover previous_state %v, want UNKNOWN", second.GetPreviousState())
	}
	wantCheckpoint(t, "takeover", second.GetRecord(), checkpointed, []byte("r_1"), at)

	before := e.mustLookup("s", "k")
	e.clock.Advance(time.Second)
	_, err := e.heartbeat("s", "k", first.GetLeaseToken(), "charged", []byte("stale"))
	wantCode(t, err, codes.FailedPrecondition, reasonLost)
	if after := e.mustLookup("s", "k"); !proto.Equal(after, before) {
		t.Fatalf("a fenced Heartbeat changed the record:\n%v\nwas\n%v", after, before)
	}
}

// TestCheckpointSurvivesFailures: a Fail RETRYABLE and a Fail UNKNOWN keep
// the checkpoint, and the next acquiring Begin returns it.
func TestCheckpointSurvivesFailures(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	for _, kind := range []idempotencyv1.FailureKind{idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE, idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN} {
		t.Run(kind.String(), func(t *testing.T) {
			key := kind.String()
			b := e.mustBegin("s", key, acq)
			at := e.clock.Now()
			if _, err := e.heartbeat("s", key, b.GetLeaseToken(), checkpointed, []byte("r_1")); err != nil {
				t.Fatal(err)
			}
			if _, err := e.fail("s", key, b.GetLeaseToken(), kind, nil); err != nil {
				t.Fatal(err)
			}
			wantCheckpoint(t, "after the Fail", e.mustLookup("s", key), checkpointed, []byte("r_1"), at)
			next := e.mustBegin("s", key, acq)
			wantCheckpoint(t, "next Begin", next.GetRecord(), checkpointed, []byte("r_1"), at)
		})
	}
}

// TestCheckpointKeptUntilExpiry: a completed record keeps its last
// checkpoint; once it expires it reads without it (and the reaper drops
// it with the body), and the next generation starts without one.
func TestCheckpointKeptUntilExpiry(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	b := e.mustBegin("s", "k", acq)
	at := e.clock.Now()
	if _, err := e.heartbeat("s", "k", b.GetLeaseToken(), "charged", []byte("ch_1")); err != nil {
		t.Fatal(err)
	}
	done, err := e.client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "s", Key: "k", LeaseToken: b.GetLeaseToken(),
		Response: &idempotencyv1.StoredResponse{Body: []byte("ok")}})
	if err != nil {
		t.Fatal(err)
	}
	wantCheckpoint(t, "Complete answer", done.GetRecord(), "charged", []byte("ch_1"), at)
	wantCheckpoint(t, "completed", e.mustLookup("s", "k"), "charged", []byte("ch_1"), at)
	replay := e.mustBegin("s", "k", idempotencyv1.Outcome_OUTCOME_REPLAY)
	wantCheckpoint(t, "replay", replay.GetRecord(), "charged", []byte("ch_1"), at)
	replay = e.mustBegin("s", "k", idempotencyv1.Outcome_OUTCOME_REPLAY) // from the replay cache
	wantCheckpoint(t, "second replay", replay.GetRecord(), "charged", []byte("ch_1"), at)

	e.clock.Advance(policyTTL + time.Second)
	if got := e.mustLookup("s", "k"); got.GetState() != idempotencyv1.State_STATE_EXPIRED || got.GetCheckpoint() != nil {
		t.Fatalf("expired record: %v checkpoint %v", got.GetState(), got.GetCheckpoint())
	}
	if err := e.coord.Server.ReapOnce(context.Background()); err != nil {
		t.Fatal(err)
	}
	var phase, data *string
	if err := queryRow(t, e.dbURL, `SELECT checkpoint_phase, encode(checkpoint_data, 'hex') FROM idempotency_records`, &phase, &data); err != nil {
		t.Fatal(err)
	}
	if phase != nil || data != nil {
		t.Fatalf("the reaper left checkpoint %v %v on an expired record", phase, data)
	}
	next := e.mustBegin("s", "k", acq)
	if next.GetRecord().GetGeneration() != 2 || next.GetRecord().GetCheckpoint() != nil {
		t.Fatalf("new generation %d with checkpoint %v", next.GetRecord().GetGeneration(), next.GetRecord().GetCheckpoint())
	}
}

// TestCheckpointRefusesBadInput: data over limits.max_checkpoint_bytes and
// a phase that is empty, too long or not printable are INVALID_ARGUMENT,
// with the field named, and write nothing (not even the lease).
func TestCheckpointRefusesBadInput(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{config: "limits: { max_checkpoint_bytes: 16 }\n"})
	b := e.mustBegin("s", "k", acq)
	before := e.mustLookup("s", "k")
	e.clock.Advance(time.Second)
	for _, c := range []struct {
		name, phase, field string
		data               []byte
	}{
		{"data over the limit", "p", "checkpoint.data", bytes.Repeat([]byte("x"), 17)},
		{"empty phase", "", "checkpoint.phase", nil},
		{"phase of 129 bytes", strings.Repeat("p", 129), "checkpoint.phase", nil},
		{"phase with a newline", "a\nb", "checkpoint.phase", nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := e.heartbeat("s", "k", b.GetLeaseToken(), c.phase, c.data)
			st := wantCode(t, err, codes.InvalidArgument, "")
			var fields []string
			for _, d := range st.Details() {
				if br, ok := d.(*errdetails.BadRequest); ok {
					for _, v := range br.GetFieldViolations() {
						fields = append(fields, v.GetField())
					}
				}
			}
			if len(fields) != 1 || fields[0] != c.field {
				t.Fatalf("field violations %v, want %s", fields, c.field)
			}
			if after := e.mustLookup("s", "k"); !proto.Equal(after, before) {
				t.Fatalf("a refused Heartbeat changed the record:\n%v\nwas\n%v", after, before)
			}
		})
	}
	// At the limit and 128 bytes of phase are fine.
	if _, err := e.heartbeat("s", "k", b.GetLeaseToken(), strings.Repeat("p", 128), bytes.Repeat([]byte("x"), 16)); err != nil {
		t.Fatal(err)
	}
}

// TestCheckpointAbandon: the attempt that recorded a checkpoint cannot
// end Fail ABANDONED (CHECKPOINT_RECORDED, the record unchanged and still
// held); a later attempt that recorded none can, and the key goes back to
// FAILED_RETRYABLE with the checkpoint kept for the next one.
func TestCheckpointAbandon(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	abandoned := idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED
	b, at := e.beginCheckpointed()
	before := e.mustLookup("s", "k")
	_, err := e.fail("s", "k", b.GetLeaseToken(), abandoned, nil)
	wantCode(t, err, codes.FailedPrecondition, reasonCkpt)
	if after := e.mustLookup("s", "k"); !proto.Equal(after, before) || after.GetState() != idempotencyv1.State_STATE_IN_PROGRESS {
		t.Fatalf("a refused ABANDONED changed the record:\n%v\nwas\n%v", after, before)
	}
	// The holder still holds it: RETRYABLE is what it can say.
	if _, err := e.fail("s", "k", b.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE, nil); err != nil {
		t.Fatal(err)
	}
	second := e.mustBegin("s", "k", acq)
	if second.GetPreviousState() != prevRetry {
		t.Fatalf("previous_state %v", second.GetPreviousState())
	}
	if _, err := e.fail("s", "k", second.GetLeaseToken(), abandoned, nil); err != nil {
		t.Fatalf("ABANDONED of an attempt that recorded no checkpoint: %v", err)
	}
	got := e.mustLookup("s", "k")
	if got.GetState() != idempotencyv1.State_STATE_FAILED_RETRYABLE || got.GetAttempt() != 1 {
		t.Fatalf("after the release: %v attempt %d, want FAILED_RETRYABLE attempt 1", got.GetState(), got.GetAttempt())
	}
	wantCheckpoint(t, "after the release", got, checkpointed, []byte("r_1"), at)
	third := e.mustBegin("s", "k", acq)
	wantCheckpoint(t, "next Begin", third.GetRecord(), checkpointed, []byte("r_1"), at)
}

// TestCheckpointAbandonedTakeover: attempt 1 records a checkpoint and fails
// UNKNOWN; attempt 2 takes over and is abandoned, which puts the record
// back to UNKNOWN and attempt 1 (written to the database as such); its
// token then fails UNKNOWN and ABANDONED again. Attempt 2 never recorded
// the checkpoint, so neither ABANDONED is refused, and the checkpoint is
// still the generation's for the next attempt.
func TestCheckpointAbandonedTakeover(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	first, at := e.beginCheckpointed()
	e.mustFail("s", "k", first.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN, nil)
	second := e.mustBegin("s", "k", acq)
	if second.GetPreviousState() != prevUnknown {
		t.Fatalf("previous_state %v, want UNKNOWN", second.GetPreviousState())
	}
	e.mustFail("s", "k", second.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED, nil)
	if got := e.mustLookup("s", "k"); got.GetState() != idempotencyv1.State_STATE_UNKNOWN || got.GetAttempt() != 1 {
		t.Fatalf("after the takeover's ABANDONED: %v attempt %d, want UNKNOWN attempt 1", got.GetState(), got.GetAttempt())
	}
	e.mustFail("s", "k", second.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN, nil)
	if _, err := e.fail("s", "k", second.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED, nil); err != nil {
		t.Fatalf("ABANDONED of the taken-over attempt, which recorded no checkpoint: %v", err)
	}
	got := e.mustLookup("s", "k")
	if got.GetState() != idempotencyv1.State_STATE_UNKNOWN {
		t.Fatalf("after the second ABANDONED: %v, want UNKNOWN", got.GetState())
	}
	wantCheckpoint(t, "after the second ABANDONED", got, checkpointed, []byte("r_1"), at)
	third := e.mustBegin("s", "k", acq)
	wantCheckpoint(t, "next Begin", third.GetRecord(), checkpointed, []byte("r_1"), at)
}

// TestCheckpointSurvivesRestart: the checkpoint is in the database, so a
// new coordinator on it hands it to the next attempt.
func TestCheckpointSurvivesRestart(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	_, at := e.beginCheckpointed()
	e.coord.Restart()
	e.client = idempotencyv1.NewCoordinatorClient(e.coord.Dial(t))
	e.clock.Advance(policyLease + time.Second)
	next := e.mustBegin("s", "k", acq)
	wantCheckpoint(t, "after a restart", next.GetRecord(), checkpointed, []byte("r_1"), at)
}

// TestCheckpointThroughBatch: a Heartbeat call of a Batch records its
// checkpoint, and a refused one in the same Batch fails alone.
func TestCheckpointThroughBatch(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	b := e.mustBegin("s", "k", acq)
	at := e.clock.Now()
	hb := func(token, phase string) *idempotencyv1.BatchCall {
		return &idempotencyv1.BatchCall{Call: &idempotencyv1.BatchCall_Heartbeat{Heartbeat: &idempotencyv1.HeartbeatRequest{
			Scope: "s", Key: "k", LeaseToken: token, Checkpoint: &idempotencyv1.Checkpoint{Phase: phase, Data: []byte("ch_1")}}}}
	}
	resp, err := e.client.Batch(ctx(t), &idempotencyv1.BatchRequest{Calls: []*idempotencyv1.BatchCall{
		hb("lt1.not-the-token", "stale"), hb(b.GetLeaseToken(), "charged")}})
	if err != nil {
		t.Fatal(err)
	}
	res := resp.GetResults()
	if len(res) != 2 || res[0].GetError().GetCode() != int32(codes.FailedPrecondition) || res[1].GetHeartbeat() == nil {
		t.Fatalf("results %v", res)
	}
	wantCheckpoint(t, "Batch answer", res[1].GetHeartbeat().GetRecord(), "charged", []byte("ch_1"), at)
	wantCheckpoint(t, "Lookup", e.mustLookup("s", "k"), "charged", []byte("ch_1"), at)
}

// TestCheckpointSealed: with encryption at rest, the checkpoint's data is
// never in clear in the table, and reads back (after the row was
// rewritten by a takeover too).
func TestCheckpointSealed(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{config: sealedConfig(t, "")})
	secret := []byte("ch_3MtwBwLkdIwHu7ix")
	b := e.mustBegin("s", "k", acq)
	at := e.clock.Now()
	if _, err := e.heartbeat("s", "k", b.GetLeaseToken(), "charged", secret); err != nil {
		t.Fatal(err)
	}
	table := wholeTable(t, e.dbURL)
	if strings.Contains(table, hex.EncodeToString(secret)) || strings.Contains(table, string(secret)) {
		t.Fatalf("checkpoint data in clear in the table:\n%s", table)
	}
	if !strings.Contains(table, "charged") {
		t.Fatalf("the phase is not in the row:\n%s", table)
	}
	wantCheckpoint(t, "Lookup", e.mustLookup("s", "k"), "charged", secret, at)
	e.clock.Advance(policyLease + time.Second)
	next := e.mustBegin("s", "k", acq)
	wantCheckpoint(t, "takeover", next.GetRecord(), "charged", secret, at)
	wantCheckpoint(t, "Lookup after the takeover", e.mustLookup("s", "k"), "charged", secret, at)

	// Moved to another record, the sealed data no longer opens.
	e.mustBegin("s", "other", acq)
	var phase string
	var data []byte
	var cpAt time.Time
	var attempt int32
	if err := queryRow(t, e.dbURL, `SELECT checkpoint_phase, checkpoint_data, checkpoint_at, checkpoint_attempt
		FROM idempotency_records WHERE key = 'k'`, &phase, &data, &cpAt, &attempt); err != nil {
		t.Fatal(err)
	}
	execSQL(t, e.dbURL, `UPDATE idempotency_records SET checkpoint_phase = $1, checkpoint_data = $2,
		checkpoint_at = $3, checkpoint_attempt = $4 WHERE key = 'other'`, phase, data, cpAt, attempt)
	_, err := e.client.Lookup(ctx(t), &idempotencyv1.LookupRequest{Scope: "s", Key: "other"})
	wantCode(t, err, codes.DataLoss, "RECORD_UNREADABLE")
}

// TestListRecordsByCheckpointPhase: ListRecords with checkpoint_phase
// pages through the records whose last checkpoint has that phase (listed
// with the phase and time, without the data); a page token of another
// phase is refused, as is a phase that is not printable; GetRecord shows
// the checkpoint with its data.
func TestListRecordsByCheckpointPhase(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	admin := e.admin()
	for _, k := range []struct{ key, phase string }{{"a", "charged"}, {"b", "reserved"}, {"c", "charged"}, {"d", ""}} {
		b := e.mustBegin("s", k.key, acq)
		if k.phase != "" {
			if _, err := e.heartbeat("s", k.key, b.GetLeaseToken(), k.phase, []byte("data-"+k.key)); err != nil {
				t.Fatal(err)
			}
		}
	}
	var keys []string
	req := &idempotencyv1.ListRecordsRequest{CheckpointPhase: "charged", PageSize: 1}
	for {
		page, err := admin.ListRecords(ctx(t), req)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range page.GetRecords() {
			if c := r.GetCheckpoint(); c.GetPhase() != "charged" || c.GetData() != nil || c.GetAt() == nil {
				t.Fatalf("listed %s with checkpoint %v, want the phase and time without data", r.GetKey(), c)
			}
			keys = append(keys, r.GetKey())
		}
		if page.GetNextPageToken() == "" {
			break
		}
		req.PageToken = page.GetNextPageToken()
		other := proto.CloneOf(req)
		other.CheckpointPhase = "reserved"
		_, err = admin.ListRecords(ctx(t), other)
		wantCode(t, err, codes.InvalidArgument, "")
	}
	if strings.Join(keys, ",") != "a,c" {
		t.Fatalf("listed %v, want a and c", keys)
	}
	_, err := admin.ListRecords(ctx(t), &idempotencyv1.ListRecordsRequest{CheckpointPhase: "a\nb"})
	wantCode(t, err, codes.InvalidArgument, "")
	rec, err := admin.GetRecord(ctx(t), &idempotencyv1.GetRecordRequest{Scope: "s", Key: "b"})
	if err != nil {
		t.Fatal(err)
	}
	if c := rec.GetRecord().GetCheckpoint(); c.GetPhase() != "reserved" || string(c.GetData()) != "data-b" {
		t.Fatalf("GetRecord: checkpoint %v", c)
	}
}

// TestCheckpointOverHTTP: the HTTP/JSON listener carries checkpoints as
// the gRPC API does: Heartbeat records one (data as base64 in JSON), the
// next acquiring Begin returns it, and an ABANDONED of its attempt is
// refused with reason CHECKPOINT_RECORDED.
func TestCheckpointOverHTTP(t *testing.T) {
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{})
	api := newHTTPAPI(t, c)
	token, _ := api.post(httpBegin, `{"scope":"build","key":"k"}`).json(t)["leaseToken"].(string)
	r := api.post("idempotency.v1.Coordinator/Heartbeat", `{"scope":"build","key":"k","leaseToken":"`+token+
		`","checkpoint":{"phase":"charged","data":"Y2hfMQ=="}}`)
	if cp, _ := r.json(t)["record"].(map[string]any)["checkpoint"].(map[string]any); r.status != http.StatusOK ||
		cp["phase"] != "charged" || cp["data"] != "Y2hfMQ==" || cp["at"] == nil {
		t.Fatalf("Heartbeat with a checkpoint: HTTP %d %s", r.status, r.body)
	}
	api.post("idempotency.v1.Coordinator/Fail", `{"scope":"build","key":"k","leaseToken":"`+token+`","kind":"FAILURE_KIND_ABANDONED"}`).
		wantError(t, http.StatusBadRequest, "failed_precondition", reasonCkpt)
	api.post("idempotency.v1.Coordinator/Fail", `{"scope":"build","key":"k","leaseToken":"`+token+`","kind":"FAILURE_KIND_RETRYABLE"}`)
	m := api.post(httpBegin, `{"scope":"build","key":"k"}`).json(t)
	if cp, _ := m["record"].(map[string]any)["checkpoint"].(map[string]any); m["outcome"] != "OUTCOME_ACQUIRED" || cp["data"] != "Y2hfMQ==" {
		t.Fatalf("next Begin: %v", m)
	}
}
