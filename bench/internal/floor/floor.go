// Package floor is the server under the floor of the coordinator's unary
// path: a grpc-go server of the coordinator's service that answers Begin
// and Complete with canned answers of the coordinator's size, with no
// interceptors, no validation and no database. What callers of the
// generated stub reach against it is what grpc-go itself allows on the
// machine: the bench (`make bench`, the "floor" rows) and
// bench/grpcfloor measure it as a separate process, as the coordinator
// is one.
package floor

import (
	"context"
	"net"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/timestamppb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// ReplayPrefix starts the keys that Begin answers as a replay; every other
// key is acquired.
const ReplayPrefix = "replay-"

// The coordinator's transport settings (server.New and its gRPC
// listener): stream workers and static flow-control windows, so that the
// floor's HTTP/2 behaves as the coordinator's does.
const (
	streamWorkers = 256
	streamWindow  = 64 << 10
	connWindow    = 1 << 20
)

// Server answers the coordinator's Begin and Complete with canned answers.
type Server struct {
	idempotencyv1.UnimplementedCoordinatorServer
	acquired, replay *idempotencyv1.BeginResponse
	complete         *idempotencyv1.CompleteResponse
}

// New returns a Server whose stored responses (a replay's, a Complete's)
// hold a body of bodyBytes bytes.
func New(bodyBytes int) *Server {
	body := make([]byte, bodyBytes)
	return &Server{
		acquired: &idempotencyv1.BeginResponse{Outcome: idempotencyv1.Outcome_OUTCOME_ACQUIRED,
			LeaseToken: "lt1.0123456789abcdef01234567", Record: record(idempotencyv1.State_STATE_IN_PROGRESS, nil)},
		replay: &idempotencyv1.BeginResponse{Outcome: idempotencyv1.Outcome_OUTCOME_REPLAY,
			Record: record(idempotencyv1.State_STATE_COMPLETED, body)},
		complete: &idempotencyv1.CompleteResponse{Record: record(idempotencyv1.State_STATE_COMPLETED, body)},
	}
}

// Begin answers REPLAY for a key that starts with ReplayPrefix and
// ACQUIRED for any other.
func (s *Server) Begin(_ context.Context, req *idempotencyv1.BeginRequest) (*idempotencyv1.BeginResponse, error) {
	if strings.HasPrefix(req.GetKey(), ReplayPrefix) {
		return s.replay, nil
	}
	return s.acquired, nil
}

// Complete answers with a COMPLETED record holding the stored response.
func (s *Server) Complete(context.Context, *idempotencyv1.CompleteRequest) (*idempotencyv1.CompleteResponse, error) {
	return s.complete, nil
}

// record is a record of the size the coordinator answers with.
func record(state idempotencyv1.State, body []byte) *idempotencyv1.Record {
	now := timestamppb.Now()
	rec := &idempotencyv1.Record{Scope: "bench", Key: "0123456789abcdef0123456789abcdef", State: state, Attempt: 1, Generation: 1,
		Fingerprint: make([]byte, 32), CreatedAt: now, UpdatedAt: now, LeaseExpiresAt: now, ExpiresAt: now}
	if body != nil {
		rec.Response = &idempotencyv1.StoredResponse{SchemaVersion: "bench.v1.Response/1",
			ContentType: "application/x-protobuf", Body: body}
	}
	return rec
}

// Serve serves a Server with bodyBytes-byte stored responses on addr, with
// the coordinator's stream workers and flow-control windows, until the
// listener fails.
func Serve(addr string, bodyBytes int) error {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	s := grpc.NewServer(grpc.NumStreamWorkers(streamWorkers),
		grpc.InitialWindowSize(streamWindow), grpc.InitialConnWindowSize(connWindow))
	idempotencyv1.RegisterCoordinatorServer(s, New(bodyBytes))
	return s.Serve(lis)
}
