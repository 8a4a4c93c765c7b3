package main

import (
	"context"
	"net"
	"sync"
	"testing"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
)

// collector is a minimal OTLP/gRPC trace collector that remembers span
// names.
type collector struct {
	coltracepb.UnimplementedTraceServiceServer
	mu    sync.Mutex
	spans map[string]string // name -> trace id (hex)
}

func (c *collector) Export(_ context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			for _, sp := range ss.GetSpans() {
				c.spans[sp.GetName()] = hexString(sp.GetTraceId())
			}
		}
	}
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

func hexString(b []byte) string {
	const digits = "0123456789abcdef"
	out := make([]byte, 0, 2*len(b))
	for _, c := range b {
		out = append(out, digits[c>>4], digits[c&15])
	}
	return string(out)
}

// TestTracingExportsSpans runs the binary with --otlp-endpoint pointing at a
// test collector: a Begin produces a server span that continues the
// caller's W3C trace.
func TestTracingExportsSpans(t *testing.T) {
	col := &collector{spans: map[string]string{}}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	coltracepb.RegisterTraceServiceServer(gs, col)
	go func() { _ = gs.Serve(lis) }()
	defer gs.Stop()

	p := startBinary(t, coordtest.BuildBinary(t), pgtest.NewDatabase(t), coordtest.FreeAddr(t), coordtest.FreeAddr(t),
		"--otlp-endpoint", "http://"+lis.Addr().String())
	conn, err := grpc.NewClient(p.grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	ctx := metadata.AppendToOutgoingContext(context.Background(), "traceparent", "00-"+traceID+"-00f067aa0ba902b7-01")
	if _, err := idempotencyv1.NewCoordinatorClient(conn).Begin(ctx, &idempotencyv1.BeginRequest{Scope: "s", Key: "k"}); err != nil {
		t.Fatal(err)
	}
	p.stop() // flushes the batch exporter

	col.mu.Lock()
	defer col.mu.Unlock()
	got, ok := col.spans["idempotency.v1.Coordinator/Begin"]
	if !ok {
		t.Fatalf("no Begin span exported; spans: %v", col.spans)
	}
	if got != traceID {
		t.Fatalf("Begin span in trace %s, want the caller's %s", got, traceID)
	}
}
