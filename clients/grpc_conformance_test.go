package clients_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemcoord/idemcoord/clients"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
)

// grpcConformance is clients/testdata/grpc_conformance.json, the suite
// that every gRPC server interceptor (Go, Node, Python) runs; its "about"
// says what each field means.
type grpcConformance struct {
	ClientLeaseMS int `json:"client_lease_ms"`
	Scenarios     []struct {
		Name    string            `json:"name"`
		Skip    map[string]string `json:"skip"`
		HoldKey bool              `json:"hold_key"`
		Options struct {
			WaitMS     int  `json:"wait_ms"`
			RequireKey bool `json:"require_key"`
		} `json:"options"`
		Steps        []grpcStep `json:"steps"`
		State        string     `json:"state"`
		HandlerCalls *int       `json:"handler_calls"`
	} `json:"scenarios"`
}

type grpcStep struct {
	Background   bool              `json:"background"`
	StartAfterMS int               `json:"start_after_ms"`
	TimeoutMS    int               `json:"timeout_ms"`
	Repeat       int               `json:"repeat"`
	ReleaseHold  bool              `json:"release_hold"`
	SettleMS     int               `json:"settle_ms"`
	State        string            `json:"state"`
	Metadata     map[string]string `json:"metadata"`
	RequestScope string            `json:"request_scope"`
	Handler      json.RawMessage   `json:"handler"`
	Expect       struct {
		Code     string  `json:"code"`
		Message  *string `json:"message"`
		Token    *string `json:"token"`
		Result   *string `json:"result"`
		Pushback bool    `json:"pushback"`
	} `json:"expect"`
	ExpectCounts map[string]int `json:"expect_counts"`
}

const conformanceMethod = "/idempotency.v1.Coordinator/Begin"

// conformanceService answers Begin as the call's x-conformance says.
type conformanceService struct {
	idempotencyv1.UnimplementedCoordinatorServer
	mu    sync.Mutex
	calls map[string]int
}

func (s *conformanceService) Begin(ctx context.Context, _ *idempotencyv1.BeginRequest) (*idempotencyv1.BeginResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	first := func(k string) string {
		if v := md.Get(k); len(v) > 0 {
			return v[0]
		}
		return ""
	}
	s.mu.Lock()
	s.calls[first("x-scenario")]++
	s.mu.Unlock()
	var a struct {
		SleepMS        int    `json:"sleep_ms"`
		Mark           bool   `json:"mark"`
		Throw          bool   `json:"throw"`
		Code           string `json:"code"`
		Message        string `json:"message"`
		Token          string `json:"token"`
		EchoLease      bool   `json:"echo_lease"`
		UntilCancelled bool   `json:"until_cancelled"`
	}
	_ = json.Unmarshal([]byte(first("x-conformance")), &a)
	time.Sleep(time.Duration(a.SleepMS) * time.Millisecond)
	if a.Mark {
		clients.MarkSideEffect(ctx)
	}
	if a.Throw {
		panic("the conformance handler throws")
	}
	if a.UntilCancelled {
		select {
		case <-ctx.Done():
		case <-time.After(5 * time.Second):
		}
		return nil, status.Error(codes.Canceled, "cancelled")
	}
	if a.Code != "" {
		return nil, status.Error(codeByName(a.Code), a.Message)
	}
	if a.EchoLease {
		l, _ := clients.LeaseFrom(ctx)
		return &idempotencyv1.BeginResponse{LeaseToken: fmt.Sprintf("%d %s", l.Attempt, l.Previous)}, nil
	}
	return &idempotencyv1.BeginResponse{LeaseToken: a.Token}, nil
}

func codeByName(name string) codes.Code {
	for c := codes.OK; c <= codes.Unauthenticated; c++ {
		if strings.EqualFold(strings.ReplaceAll(name, "_", ""), strings.ReplaceAll(c.String(), "_", "")) ||
			(name == "CANCELLED" && c == codes.Canceled) {
			return c
		}
	}
	return codes.Unknown
}

func codeName(c codes.Code) string {
	if c == codes.Canceled {
		return "CANCELLED"
	}
	var b strings.Builder
	prev := rune(0)
	for _, r := range c.String() {
		if prev >= 'a' && prev <= 'z' && r >= 'A' && r <= 'Z' {
			b.WriteByte('_')
		}
		b.WriteRune(r)
		prev = r
	}
	return strings.ToUpper(b.String())
}

// TestGRPCConformance runs the shared gRPC suite against UnaryServerInterceptor.
func TestGRPCConformance(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("testdata/grpc_conformance.json")
	if err != nil {
		t.Fatal(err)
	}
	var suite grpcConformance
	if err := json.Unmarshal(raw, &suite); err != nil {
		t.Fatal(err)
	}
	coord := coordtest.Start(t, coordtest.Options{})
	logger := slog.New(slog.NewTextHandler(testLog{t}, &slog.HandlerOptions{Level: slog.LevelError}))
	idem := clients.New(coord.Dial(t), clients.WithLogger(logger),
		clients.WithLease(time.Duration(suite.ClientLeaseMS)*time.Millisecond))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_ = idem.Shutdown(ctx)
	})
	svc := &conformanceService{calls: map[string]int{}}
	for _, sc := range suite.Scenarios {
		t.Run(sc.Name, func(t *testing.T) {
			if why := sc.Skip["go"]; why != "" {
				t.Skip(why)
			}
			t.Parallel()
			opts := []clients.InterceptorOption{clients.WithoutPrincipal(),
				clients.WithWaitForResult(time.Duration(sc.Options.WaitMS) * time.Millisecond)}
			if sc.Options.RequireKey {
				opts = append(opts, clients.WithRequireKey())
			}
			srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
				recovery.UnaryServerInterceptor(recovery.WithRecoveryHandler(func(any) error {
					return status.Error(codes.Unknown, "the handler panicked")
				})),
				clients.UnaryServerInterceptor(idem, opts...)))
			idempotencyv1.RegisterCoordinatorServer(srv, svc)
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
			api := idempotencyv1.NewCoordinatorClient(conn)
			var b [12]byte
			_, _ = rand.Read(b[:])
			key := "conf-" + hex.EncodeToString(b[:])
			lookup := func() string {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				res, err := idem.Lookup(ctx, &idempotencyv1.LookupRequest{Scope: conformanceMethod, Key: key})
				if status.Code(err) == codes.NotFound {
					return "absent"
				}
				if err != nil {
					t.Fatal(err)
				}
				return res.GetRecord().GetState().String()
			}
			wantState := func(want string) {
				t.Helper()
				deadline := time.Now().Add(10 * time.Second)
				for got := lookup(); got != want; got = lookup() {
					if time.Now().After(deadline) {
						t.Fatalf("state %s, want %s", got, want)
					}
					time.Sleep(50 * time.Millisecond)
				}
			}
			var holdToken string
			if sc.HoldKey {
				res, err := idem.Begin(context.Background(), &idempotencyv1.BeginRequest{Scope: conformanceMethod, Key: key, AttemptId: "holder"})
				if err != nil || res.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
					t.Fatalf("hold: %v %v", res, err)
				}
				holdToken = res.GetLeaseToken()
			}
			var wg sync.WaitGroup
			errs := make(chan error, 64)
			for i, st := range sc.Steps {
				switch {
				case st.ReleaseHold:
					time.Sleep(time.Duration(st.SettleMS) * time.Millisecond)
					if _, err := idem.Fail(context.Background(), &idempotencyv1.FailRequest{Scope: conformanceMethod, Key: key,
						LeaseToken: holdToken, Kind: idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED, Reason: "released"}); err != nil {
						t.Fatalf("step %d: release: %v", i, err)
					}
					continue
				case st.State != "":
					wantState(st.State)
					continue
				}
				run := func() {
					time.Sleep(time.Duration(st.StartAfterMS) * time.Millisecond)
					n := max(st.Repeat, 1)
					results := make(chan string, n)
					var inner sync.WaitGroup
					for range n {
						inner.Go(func() {
							r, err := grpcConformanceCall(api, key, st)
							if err != nil {
								errs <- fmt.Errorf("step %d: %w", i, err)
								return
							}
							results <- r
						})
					}
					inner.Wait()
					close(results)
					if st.ExpectCounts != nil {
						got := map[string]int{}
						for r := range results {
							got[r]++
						}
						for k, v := range st.ExpectCounts {
							if got[k] != v {
								errs <- fmt.Errorf("step %d: idempotency-result counts %v", i, got)
							}
						}
					}
				}
				if st.Background {
					wg.Go(run)
				} else {
					run()
				}
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			if sc.State != "" {
				wantState(sc.State)
			}
			if sc.HandlerCalls != nil {
				svc.mu.Lock()
				got := svc.calls[key]
				svc.mu.Unlock()
				if got != *sc.HandlerCalls {
					t.Errorf("handler ran %d times, want %d", got, *sc.HandlerCalls)
				}
			}
		})
	}
}

// grpcConformanceCall makes a step's call and checks the answer; it
// returns its idempotency-result header.
func grpcConformanceCall(api idempotencyv1.CoordinatorClient, key string, st grpcStep) (string, error) {
	ctx := context.Background()
	if st.TimeoutMS > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, time.Duration(st.TimeoutMS)*time.Millisecond)
		defer cancel()
	}
	md := metadata.Pairs("x-scenario", key, "x-conformance", string(st.Handler))
	for k, v := range st.Metadata {
		md.Append(k, strings.ReplaceAll(v, "{key}", key))
	}
	var header, trailer metadata.MD
	res, err := api.Begin(metadata.NewOutgoingContext(ctx, md), &idempotencyv1.BeginRequest{Scope: st.RequestScope, Key: "k"},
		grpc.Header(&header), grpc.Trailer(&trailer))
	e := st.Expect
	got := codeName(status.Code(err))
	result := ""
	if v := header.Get(clients.ResultHeader); len(v) > 0 {
		result = v[0]
	}
	where := fmt.Sprintf("got %s %v (header %v, trailer %v, response %v)", got, err, header, trailer, res)
	switch {
	case !slices.Contains(strings.Split(e.Code, "|"), got):
		return "", fmt.Errorf("want code %s; %s", e.Code, where)
	case e.Message != nil && status.Convert(err).Message() != *e.Message:
		return "", fmt.Errorf("want message %q; %s", *e.Message, where)
	case e.Token != nil && res.GetLeaseToken() != *e.Token:
		return "", fmt.Errorf("want token %q; %s", *e.Token, where)
	case e.Result != nil && result != *e.Result:
		return "", fmt.Errorf("want idempotency-result %q; %s", *e.Result, where)
	case e.Pushback && len(trailer.Get(clients.PushbackTrailer)) == 0:
		return "", fmt.Errorf("want a %s trailer; %s", clients.PushbackTrailer, where)
	}
	return result, nil
}
