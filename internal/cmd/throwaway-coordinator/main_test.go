package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
)

// TestRun starts a throwaway coordinator as the Node and Python suites do,
// calls it with and without the token it printed, and checks that closing
// stdin stops it.
func TestRun(t *testing.T) {
	stdinR, stdinW := io.Pipe()
	stdoutR, stdoutW := io.Pipe()
	done := make(chan error, 1)
	go func() {
		done <- run(context.Background(), []string{"-bin", coordtest.BuildBinary(t)}, stdinR, stdoutW)
		stdoutW.Close()
	}()
	line, err := bufio.NewReader(stdoutR).ReadBytes('\n')
	if err != nil {
		t.Fatalf("no line: %v (run: %v)", err, <-done)
	}
	go func() { _, _ = io.Copy(io.Discard, stdoutR) }()
	var info struct{ Addr, Token string }
	if err := json.Unmarshal(line, &info); err != nil || info.Addr == "" || info.Token == "" {
		t.Fatalf("line %q: %v", line, err)
	}
	conn, err := grpc.NewClient(info.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	rpc := idempotencyv1.NewCoordinatorClient(conn)
	req := &idempotencyv1.LookupRequest{Scope: "s", Key: "k"}
	if _, err := rpc.Lookup(context.Background(), req); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("without the token: %v, want UNAUTHENTICATED", err)
	}
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+info.Token)
	if _, err := rpc.Lookup(ctx, req); status.Code(err) != codes.NotFound {
		t.Fatalf("with the token: %v, want NOT_FOUND", err)
	}
	stdinW.Close()
	if err := <-done; err != nil {
		t.Fatalf("run: %v", err)
	}
	if _, err := rpc.Lookup(ctx, req, grpc.WaitForReady(false)); status.Code(err) != codes.Unavailable {
		t.Fatalf("after stdin closed: %v, want UNAVAILABLE", err)
	}
}
