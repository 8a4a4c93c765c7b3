package clients_test

import (
	"context"
	"fmt"
	"net/http"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemcoord/idemcoord/clients"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// A service authenticates to a coordinator with auth on with its tenant's
// token; without it every call is refused.
func ExampleWithToken() {
	conn, stop := exampleCoordinatorWith("ExampleWithToken", tenantConfig("build-service-token"))
	defer stop()

	c := clients.New(conn, clients.WithToken("build-service-token"))
	res, err := c.Begin(context.Background(), &idempotencyv1.BeginRequest{Scope: "build", Key: "commit-9f86d08"})
	fmt.Println(res.GetOutcome(), err)

	anonymous := clients.New(conn, clients.WithMaxAttempts(1))
	_, err = anonymous.Begin(context.Background(), &idempotencyv1.BeginRequest{Scope: "build", Key: "commit-9f86d08"})
	fmt.Println(status.Code(err) == codes.Unauthenticated)
	// Output:
	// OUTCOME_ACQUIRED <nil>
	// true
}

// One key for one operation, made before your own retry loop: every call
// made with ctx sends it, with or without UnaryClientInterceptor.
func ExampleWithIdempotencyKey() {
	ctx := clients.WithIdempotencyKey(context.Background(), "charge-order-42")
	md, _ := metadata.FromOutgoingContext(ctx)
	fmt.Println(md.Get(clients.MetadataKey))
	// Output:
	// [charge-order-42]
}

// Stamp the key once, before the retry loop: the request keeps it, and a
// second stamp returns the same key.
func ExampleStampIdempotencyKey() {
	req, _ := http.NewRequest(http.MethodPost, "http://127.0.0.1:8080/projects", nil)
	key := clients.StampIdempotencyKey(req)
	fmt.Println(req.Header.Get("Idempotency-Key") == `"`+key+`"`, len(key))
	fmt.Println(clients.StampIdempotencyKey(req) == key)
	// Output:
	// true 36
	// true
}
