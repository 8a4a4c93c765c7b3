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

// TestRestart stops the coordinator with a "stop" line and starts it again
// with "start": it answers on the same address from the same database.
func TestRestart(t *testing.T) {
	stdinR, stdinW := io.Pipe()
	stdoutR, stdoutW := io.Pipe()
	done := make(chan error, 1)
	go func() {
		done <- run(context.Background(), []string{"-bin", coordtest.BuildBinary(t)}, stdinR, stdoutW)
		stdoutW.Close()
	}()
	out := bufio.NewReader(stdoutR)
	readLine := func() string {
		t.Helper()
		line, err := out.ReadString('\n')
		if err != nil {
			t.Fatalf("no line: %v", err)
		}
		return line
	}
	var info struct{ Addr, Token string }
	if err := json.Unmarshal([]byte(readLine()), &info); err != nil || info.Addr == "" {
		t.Fatalf("first line: %v", err)
	}
	conn, err := grpc.NewClient(info.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	rpc := idempotencyv1.NewCoordinatorClient(conn)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+info.Token)
	if _, err := rpc.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "s", Key: "k", Fingerprint: []byte("f"),
		AttemptId: "a1"}); err != nil {
		t.Fatalf("Begin: %v", err)
	}

	_, _ = io.WriteString(stdinW, "stop\n")
	if got := readLine(); got != `{"state":"stopped"}`+"\n" {
		t.Fatalf("after stop: %q", got)
	}
	req := &idempotencyv1.LookupRequest{Scope: "s", Key: "k"}
	if _, err := rpc.Lookup(ctx, req, grpc.WaitForReady(false)); status.Code(err) != codes.Unavailable {
		t.Fatalf("stopped: %v, want UNAVAILABLE", err)
	}
	_, _ = io.WriteString(stdinW, "start\n")
	if got := readLine(); got != `{"state":"serving"}`+"\n" {
		t.Fatalf("after start: %q", got)
	}
	if _, err := rpc.Lookup(ctx, req, grpc.WaitForReady(true)); err != nil {
		t.Fatalf("Lookup of the key begun before the restart: %v", err)
	}
	stdinW.Close()
	if err := <-done; err != nil {
		t.Fatalf("run: %v", err)
	}
}
