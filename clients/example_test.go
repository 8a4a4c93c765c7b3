package clients_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"slices"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/idemcoord/idemcoord/clients"
	"github.com/idemcoord/idemcoord/examples/projects"
	projectsv1 "github.com/idemcoord/idemcoord/examples/projects/gen/projects/v1"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
)

// Typed calls: claim a key, store the result, and see a retry replay it.
func ExampleNew() {
	conn, stop := exampleCoordinator("ExampleNew") // a connection to a running idemcoord
	defer stop()

	c := clients.New(conn)
	ctx := context.Background()
	begin := &idempotencyv1.BeginRequest{Scope: "build", Key: "commit-9f86d08"}
	res, err := c.Begin(ctx, begin)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("Begin:", res.GetOutcome(), "attempt", res.GetRecord().GetAttempt())
	// ... build ...
	_, err = c.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "build", Key: "commit-9f86d08",
		LeaseToken: res.GetLeaseToken(),
		Response:   &idempotencyv1.StoredResponse{SchemaVersion: "build/1", Body: []byte("artifact sha256:2c26b4")}})
	if err != nil {
		fmt.Println(err)
		return
	}
	again, err := c.Begin(ctx, begin)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("Begin:", again.GetOutcome(), string(again.GetRecord().GetResponse().GetBody()))
	// Output:
	// Begin: OUTCOME_ACQUIRED attempt 1
	// Begin: OUTCOME_REPLAY artifact sha256:2c26b4
}

// Once runs a deployment at most once per release, whoever asks.
func ExampleClient_Once() {
	conn, stop := exampleCoordinator("ExampleClient_Once")
	defer stop()

	c := clients.New(conn)
	defer func() { // Shutdown waits for Complete/Fail still being retried
		if err := c.Shutdown(context.Background()); err != nil {
			fmt.Println("shutdown:", err)
		}
	}()
	deploy := func(ctx context.Context) (*idempotencyv1.StoredResponse, error) {
		attempt, previous, _ := clients.AttemptFrom(ctx)
		fmt.Println("deploying: attempt", attempt, "after", previous)
		return &idempotencyv1.StoredResponse{Body: []byte("v42 is live")}, nil
	}
	for range 2 {
		res, err := c.Once(context.Background(), "deploy", "release-42", nil, deploy)
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Printf("%s (replayed: %v)\n", res.Response.GetBody(), res.Replayed)
	}
	// Output:
	// deploying: attempt 1 after STATE_UNSPECIFIED
	// v42 is live (replayed: false)
	// v42 is live (replayed: true)
}

// One line makes a service's methods idempotent: a retried Charge with the
// same idempotency-key gets the stored response, not a second charge.
func ExampleUnaryServerInterceptor() {
	conn, stop := exampleCoordinator("ExampleUnaryServerInterceptor")
	defer stop()

	idem := clients.New(conn)
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(clients.UnaryServerInterceptor(idem)))
	projectsv1.RegisterProjectsServiceServer(srv, projects.NewService())
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Println(err)
		return
	}
	go func() {
		if err := srv.Serve(lis); err != nil {
			fmt.Println("serve:", err)
		}
	}()
	defer func() {
		if err := idem.Shutdown(context.Background()); err != nil {
			fmt.Println("shutdown:", err)
		}
	}()
	defer srv.Stop()

	// A caller retries the same charge with the same key.
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cc.Close()
	api := projectsv1.NewProjectsServiceClient(cc)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "idempotency-key", "7c1e5a0e-charge")
	for range 3 {
		var header metadata.MD
		resp, err := api.Charge(ctx, &projectsv1.ChargeRequest{AccountId: "acct_1", AmountCents: 1250, Currency: "EUR"},
			grpc.Header(&header))
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Println(resp.GetChargeId(), resp.GetTotalCents(), header.Get("idempotency-result"))
	}
	// Output:
	// ch_1 1250 [created]
	// ch_1 1250 [replayed]
	// ch_1 1250 [replayed]
}

// A user who submits "create Flower Shop" twice, typed differently, gets one
// key; another user gets another.
func ExampleDedupKey() {
	fmt.Println(clients.DedupKey("create-project", "user-7", "", " Flower  Shop "))
	fmt.Println(clients.DedupKey("create-project", "user-7", "", "flower shop"))
	fmt.Println(clients.DedupKey("create-project", "user-8", "", "flower shop"))
	fmt.Println(clients.DedupKey("rename-project", "user-7", "prj_12", ""))
	// Output:
	// create-project:user-7:n:324b893a5b4b810c
	// create-project:user-7:n:324b893a5b4b810c
	// create-project:user-8:n:324b893a5b4b810c
	// rename-project:user-7:p:prj_12
}

// exampleCoordinator starts a real coordinator for an Example and returns
// a connection to it and a func that stops both. Examples have no
// *testing.T, so coordtest gets exampleT, which provides what it uses.
func exampleCoordinator(name string) (*grpc.ClientConn, func()) {
	return exampleCoordinatorWith(name, "")
}

// exampleCoordinatorWith is exampleCoordinator with a config file.
func exampleCoordinatorWith(name, config string) (*grpc.ClientConn, func()) {
	t := &exampleT{name: name}
	coord := coordtest.Start(t, coordtest.Options{Config: config})
	conn, err := grpc.NewClient(coord.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		panic(err)
	}
	return conn, func() {
		if err := conn.Close(); err != nil {
			fmt.Println("close:", err)
		}
		t.close()
	}
}

// exampleT is the part of testing.TB that coordtest and pgtest use; the
// embedded (nil) TB only satisfies the interface, and calling any other
// method panics, which fails the example loudly.
type exampleT struct {
	testing.TB
	name     string
	failed   bool
	cleanups []func()
}

func (e *exampleT) Helper()      {}
func (e *exampleT) Name() string { return e.name }
func (e *exampleT) Failed() bool { return e.failed }
func (e *exampleT) Logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, format+"\n", args...) // stderr: not part of the checked output
}
func (e *exampleT) Cleanup(f func())  { e.cleanups = append(e.cleanups, f) }
func (e *exampleT) Fatal(args ...any) { panic(fmt.Sprint(args...)) }
func (e *exampleT) Fatalf(format string, args ...any) {
	panic(fmt.Sprintf(format, args...))
}
func (e *exampleT) Errorf(format string, args ...any) {
	e.failed = true
	fmt.Fprintf(os.Stderr, format+"\n", args...)
}

// close runs the cleanups, last registered first, and fails the example
// loudly if any of them (or anything before) reported an error.
func (e *exampleT) close() {
	for _, v := range slices.Backward(e.cleanups) {
		v()
	}
	if e.failed {
		panic(e.name + ": an error was reported (see stderr)")
	}
}
