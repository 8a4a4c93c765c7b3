package clients_test

import (
	"context"
	"fmt"
	"net"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/idemcoord/idemcoord/clients"
	"github.com/idemcoord/idemcoord/examples/projects"
	projectsv1 "github.com/idemcoord/idemcoord/examples/projects/gen/projects/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
)

// BenchmarkInterceptor measures what the interceptor adds to a unary call
// of a real gRPC service over loopback, against a real coordinator:
// unwrapped (no interceptor), new-key (Begin + handler + Complete) and
// replay (Begin answered from the stored response). Run with
// `go test -run '^$' -bench Interceptor ./clients`.
func BenchmarkInterceptor(b *testing.B) {
	coord := coordtest.Start(b, coordtest.Options{})
	idem := clients.New(coord.Dial(b))
	defer idem.Shutdown(context.Background())

	for _, bc := range []struct {
		name    string
		wrap    bool
		sameKey bool
	}{{"unwrapped", false, false}, {"new-key", true, false}, {"replay", true, true}} {
		b.Run(bc.name, func(b *testing.B) {
			var opts []grpc.ServerOption
			if bc.wrap {
				opts = append(opts, grpc.ChainUnaryInterceptor(clients.UnaryServerInterceptor(idem)))
			}
			srv := grpc.NewServer(opts...)
			projectsv1.RegisterProjectsServiceServer(srv, projects.NewService())
			lis, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			go func() { _ = srv.Serve(lis) }()
			defer srv.Stop()
			cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				b.Fatal(err)
			}
			defer cc.Close()
			api := projectsv1.NewProjectsServiceClient(cc)
			req := &projectsv1.ChargeRequest{AccountId: "acct_1", AmountCents: 1250, Currency: "EUR"}
			b.ResetTimer()
			for i := range b.N {
				key := fmt.Sprintf("%s-%d", bc.name, i)
				if bc.sameKey {
					key = "replayed-key"
				}
				ctx := metadata.AppendToOutgoingContext(context.Background(), "idempotency-key", key)
				if _, err := api.Charge(ctx, req); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
