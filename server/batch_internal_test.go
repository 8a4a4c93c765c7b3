package server

import (
	"context"
	"log/slog"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// A panic in a call of a Batch ends that call INTERNAL, with no detail
// sent, and is logged with its stack as a unary call's panic is; the
// chain answers the next call as usual. (No request makes a handler panic,
// so the item chain is driven here with a handler that does.)
func TestBatchCallPanicEndsItInternal(t *testing.T) {
	var logs strings.Builder
	s, err := New(nil, WithLogger(slog.New(slog.NewJSONHandler(&logs, nil))))
	if err != nil {
		t.Fatal(err)
	}
	info := &grpc.UnaryServerInfo{Server: s, FullMethod: idempotencyv1.Coordinator_Lookup_FullMethodName}
	req := &idempotencyv1.LookupRequest{Scope: "s", Key: "k"}
	resp, err := s.batchItem(context.Background(), req, info, func(context.Context, any) (any, error) {
		panic("boom at secret/path.go:42")
	})
	r := batchResult(resp, err)
	if got := r.GetError(); codes.Code(got.GetCode()) != codes.Internal || got.GetMessage() != "internal error" || len(got.GetDetails()) != 0 {
		t.Fatalf("panicking call's result = %v, want INTERNAL \"internal error\" with no details", r)
	}
	if out := logs.String(); !strings.Contains(out, "panic in call") || !strings.Contains(out, "batch_internal_test.go") {
		t.Fatalf("panic not logged with its stack:\n%s", out)
	}
	resp, err = s.batchItem(context.Background(), req, info, func(context.Context, any) (any, error) {
		return &idempotencyv1.LookupResponse{Record: &idempotencyv1.Record{Key: "k"}}, nil
	})
	if r := batchResult(resp, err); r.GetLookup().GetRecord().GetKey() != "k" {
		t.Fatalf("call after a panic: %v", r)
	}
}
