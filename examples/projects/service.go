// Package projects is idemcoord's demo service: a small gRPC service whose
// CreateProject and Charge are side effects, made idempotent by installing
// clients.UnaryServerInterceptor in one line (see NewGRPCServer).
//
// Its state lives in memory behind a mutex; "authentication" is the
// x-user-id metadata, which is enough to show how the end user is folded
// into idempotency keys. Do not copy those two parts.
package projects

import (
	"context"
	"fmt"
	"strings"
	"sync"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemcoord/idemcoord/clients"
	projectsv1 "github.com/idemcoord/idemcoord/examples/projects/gen/projects/v1"
)

// UserMetadataKey is the demo's stand-in for authentication: the calling
// user's id, sent as metadata.
const UserMetadataKey = "x-user-id"

// DefaultLimitCents is the amount above which Charge declines.
const DefaultLimitCents = 100_000

// Service implements projects.v1.ProjectsService over an in-memory store.
type Service struct {
	projectsv1.UnimplementedProjectsServiceServer

	mu          sync.Mutex
	projects    map[string]*projectsv1.Project
	order       []string
	nextProject int
	nextCharge  int
	totals      map[string]int64
}

// NewService returns an empty Service.
func NewService() *Service {
	return &Service{projects: map[string]*projectsv1.Project{}, totals: map[string]int64{}}
}

// NewGRPCServer returns a gRPC server that serves svc, with recovery, the
// demo's authentication and the idempotency interceptor over idem.
func NewGRPCServer(idem *clients.Client, svc *Service, opts ...grpc.ServerOption) *grpc.Server {
	srv := grpc.NewServer(append([]grpc.ServerOption{grpc.ChainUnaryInterceptor(
		recovery.UnaryServerInterceptor(recovery.WithRecoveryHandler(internalError)),
		Authenticate,
		clients.UnaryServerInterceptor(idem, IdempotencyOptions()...), // the one line
	)}, opts...)...)
	projectsv1.RegisterProjectsServiceServer(srv, svc)
	return srv
}

// internalError answers a recovered panic as INTERNAL, without the stack
// trace that the recovery interceptor would otherwise send.
func internalError(any) error { return status.Error(codes.Internal, "internal error") }

// IdempotencyOptions are the interceptor options of the demo:
//
//   - the end user is folded into every key, so two users who send the same
//     idempotency-key never share a record;
//   - Charge needs an idempotency-key from the client;
//   - CreateProject without one gets the deterministic key
//     clients.DedupKey("create-project", user, "", name), so a user's
//     retries of "create Flower Shop" make one project whatever the client
//     does;
//   - CreateProject's fingerprint covers the normalized name only: the
//     free-text prompt may change between retries of the same intent.
func IdempotencyOptions() []clients.InterceptorOption {
	return []clients.InterceptorOption{
		clients.WithPrincipal(func(ctx context.Context) (string, error) { return UserFrom(ctx), nil }),
		clients.WithKeyFunc(idempotencyKey),
		clients.WithFingerprintFunc(fingerprint),
		clients.WithRequireKey(),
	}
}

func idempotencyKey(ctx context.Context, req any) (string, error) {
	key, err := clients.KeyFromMetadata(ctx)
	if key != "" || err != nil {
		return key, err
	}
	if r, ok := req.(*projectsv1.CreateProjectRequest); ok {
		return clients.DedupKey("create-project", UserFrom(ctx), "", r.GetName()), nil
	}
	return "", nil
}

func fingerprint(ctx context.Context, req any) ([]byte, error) {
	method, _ := grpc.Method(ctx)
	if r, ok := req.(*projectsv1.CreateProjectRequest); ok {
		return clients.Fingerprint(method, &projectsv1.CreateProjectRequest{Name: clients.NormalizeName(r.GetName())})
	}
	msg, ok := req.(proto.Message)
	if !ok {
		return nil, nil // no fingerprint: the coordinator skips the check
	}
	return clients.Fingerprint(method, msg)
}

type userKey struct{}

// Authenticate is the demo's authentication interceptor: it takes the user
// from the x-user-id metadata and refuses calls without one.
func Authenticate(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	users := metadata.ValueFromIncomingContext(ctx, UserMetadataKey)
	if len(users) != 1 || users[0] == "" {
		return nil, status.Error(codes.Unauthenticated, "send your user id as x-user-id metadata")
	}
	return handler(context.WithValue(ctx, userKey{}, users[0]), req)
}

// UserFrom returns the user that Authenticate found.
func UserFrom(ctx context.Context) string {
	u, _ := ctx.Value(userKey{}).(string)
	return u
}

// CreateProject allocates a project id and stores the project.
func (s *Service) CreateProject(ctx context.Context, req *projectsv1.CreateProjectRequest) (*projectsv1.CreateProjectResponse, error) {
	if strings.TrimSpace(req.GetName()) == "" {
		return nil, status.Error(codes.InvalidArgument, "name is required")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.nextProject++
	p := &projectsv1.Project{Id: fmt.Sprintf("prj_%d", s.nextProject), Owner: UserFrom(ctx),
		Name: req.GetName(), Prompt: req.GetPrompt()}
	s.projects[p.GetId()] = p
	s.order = append(s.order, p.GetId())
	return &projectsv1.CreateProjectResponse{Project: proto.CloneOf(p)}, nil
}

// Charge books a charge; it declines amounts above DefaultLimitCents with
// FAILED_PRECONDITION, which the interceptor stores and replays.
func (s *Service) Charge(_ context.Context, req *projectsv1.ChargeRequest) (*projectsv1.ChargeResponse, error) {
	if req.GetAmountCents() <= 0 || req.GetAccountId() == "" {
		return nil, status.Error(codes.InvalidArgument, "account_id and a positive amount_cents are required")
	}
	if req.GetAmountCents() > DefaultLimitCents {
		st, _ := status.New(codes.FailedPrecondition, "card declined: amount above the limit").
			WithDetails(&errdetails.ErrorInfo{Reason: "CARD_DECLINED", Domain: "projects.v1"})
		return nil, st.Err()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.nextCharge++
	s.totals[req.GetAccountId()] += req.GetAmountCents()
	return &projectsv1.ChargeResponse{ChargeId: fmt.Sprintf("ch_%d", s.nextCharge), AmountCents: req.GetAmountCents(),
		Currency: req.GetCurrency(), TotalCents: s.totals[req.GetAccountId()]}, nil
}

// GetProject reads a project.
func (s *Service) GetProject(_ context.Context, req *projectsv1.GetProjectRequest) (*projectsv1.GetProjectResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p, ok := s.projects[req.GetId()]
	if !ok {
		return nil, status.Error(codes.NotFound, "no such project")
	}
	return &projectsv1.GetProjectResponse{Project: proto.CloneOf(p)}, nil
}

// Projects returns every stored project in creation order.
func (s *Service) Projects() []*projectsv1.Project {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*projectsv1.Project, 0, len(s.order))
	for _, id := range s.order {
		out = append(out, proto.CloneOf(s.projects[id]))
	}
	return out
}
