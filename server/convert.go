package server

import (
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/statemachine"
)

func recordToProto(scope, key string, rec statemachine.Record) *idempotencyv1.Record {
	out := &idempotencyv1.Record{
		Scope:          scope,
		Key:            key,
		State:          idempotencyv1.State(rec.State),
		Fingerprint:    rec.Fingerprint,
		Attempt:        rec.Attempt,
		Generation:     rec.Generation,
		FailureReason:  rec.FailureReason,
		CreatedAt:      optTimestamp(rec.CreatedAt),
		UpdatedAt:      optTimestamp(rec.UpdatedAt),
		LeaseExpiresAt: optTimestamp(rec.LeaseExpiresAt),
		ExpiresAt:      optTimestamp(rec.ExpiresAt),
		Uncertain:      rec.Uncertain,
	}
	if rec.State.Terminal() {
		out.Response = responseToProto(rec.Response)
	}
	if c := rec.Checkpoint; c != nil {
		out.Checkpoint = &idempotencyv1.Checkpoint{Phase: c.Phase, Data: c.Data, At: optTimestamp(c.At)}
	}
	return out
}

func responseToProto(r *statemachine.Response) *idempotencyv1.StoredResponse {
	if r == nil {
		return nil
	}
	return &idempotencyv1.StoredResponse{
		SchemaVersion: r.SchemaVersion,
		ContentType:   r.ContentType,
		Body:          r.Body,
		StatusCode:    r.StatusCode,
		Metadata:      r.Metadata,
	}
}

func responseFromProto(r *idempotencyv1.StoredResponse) *statemachine.Response {
	if r == nil {
		return nil
	}
	return &statemachine.Response{
		SchemaVersion: r.GetSchemaVersion(),
		ContentType:   r.GetContentType(),
		Body:          r.GetBody(),
		StatusCode:    r.GetStatusCode(),
		Metadata:      r.GetMetadata(),
	}
}

func optTimestamp(t time.Time) *timestamppb.Timestamp {
	if t.IsZero() {
		return nil
	}
	return timestamppb.New(t)
}

func optDuration(d time.Duration) *durationpb.Duration {
	if d == 0 {
		return nil
	}
	return durationpb.New(d)
}
