package server_test

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/server"
)

// TestPanicAnswersInternalWithoutTrace makes a call panic inside the server:
// the caller gets INTERNAL with no stack trace, and the server keeps serving.
func TestPanicAnswersInternalWithoutTrace(t *testing.T) {
	t.Parallel()
	boom := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		if r, ok := req.(*idempotencyv1.LookupRequest); ok && r.GetKey() == "panic" {
			panic("boom at secret/path.go:42")
		}
		return h(ctx, req)
	}
	c := coordtest.Start(t, coordtest.Options{ServerOptions: []server.Option{server.WithUnaryInterceptors(boom)}})
	client := idempotencyv1.NewCoordinatorClient(c.Dial(t))
	_, err := client.Lookup(context.Background(), &idempotencyv1.LookupRequest{Scope: "s", Key: "panic"})
	st := status.Convert(err)
	if st.Code() != codes.Internal || strings.Contains(st.Message(), "boom") || strings.Contains(st.Message(), ".go") || len(st.Details()) != 0 {
		t.Fatalf("panic answered %v %q %v", st.Code(), st.Message(), st.Details())
	}
	_, err = client.Lookup(context.Background(), &idempotencyv1.LookupRequest{Scope: "s", Key: "fine"})
	if status.Code(err) != codes.NotFound {
		t.Fatalf("after a panic: %v", err)
	}
}
