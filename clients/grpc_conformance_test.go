package clients_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
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
)

// grpcOptions, grpcStep and grpcScenario are the parts of
// clients/testdata/grpc_conformance.json, the suite that every gRPC server
// interceptor (Go, Node, Python) runs; its "about" says what each field
// means.
type grpcOptions struct {
	WaitMS     int  `json:"wait_ms"`
	RequireKey bool `json:"require_key"`
}

type grpcStep struct {
	conformanceStepBase
	Metadata     map[string]string `json:"metadata"`
	RequestScope string            `json:"request_scope"`
	Expect       struct {
		Code     string  `json:"code"`
		Message  *string `json:"message"`
		Token    *string `json:"token"`
		Result   *string `json:"result"`
		Pushback bool    `json:"pushback"`
	} `json:"expect"`
}

func (st grpcStep) checksState() bool { return st.State != "" }

type grpcScenario = conformanceScenario[grpcOptions, grpcStep]

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
	svc := &conformanceService{calls: map[string]int{}}
	conformanceRunner[grpcOptions, grpcStep]{
		path:     "testdata/grpc_conformance.json",
		scope:    conformanceMethod,
		logLevel: slog.LevelError,
		serve: func(t *testing.T, idem *clients.Client, sc grpcScenario) func(int, string, grpcStep) (string, error) {
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
			return func(i int, key string, st grpcStep) (string, error) {
				r, err := grpcConformanceCall(api, key, st)
				if err != nil {
					return "", fmt.Errorf("step %d: %w", i, err)
				}
				return r, nil
			}
		},
		handlerCalls: func(key string) int {
			svc.mu.Lock()
			defer svc.mu.Unlock()
			return svc.calls[key]
		},
		countsError: func(i int, got map[string]int) error {
			return fmt.Errorf("step %d: idempotency-result counts %v", i, got)
		},
	}.run(t)
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
