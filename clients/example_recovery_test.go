package clients_test

import (
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemcoord/idemcoord/clients"
	projectsv1 "github.com/idemcoord/idemcoord/examples/projects/gen/projects/v1"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// A function marks the moment its side effect starts. The mail goes out,
// then writing the audit log fails with UNAVAILABLE, which on its own would
// mean "nothing happened, run it again". After the mark it is recorded
// UNKNOWN instead, so the next attempt is told to check before it sends the
// mail a second time.
func ExampleMarkSideEffect() {
	conn, stop := exampleCoordinator("ExampleMarkSideEffect")
	defer stop()
	c := clients.New(conn)
	defer c.Shutdown(context.Background())

	sent := 0
	sendWelcome := func(ctx context.Context) (*idempotencyv1.StoredResponse, error) {
		_, previous, _ := clients.AttemptFrom(ctx)
		if previous == idempotencyv1.State_STATE_UNKNOWN && sent > 0 { // ask the mail provider
			fmt.Println("checked the mail provider: already sent")
			return &idempotencyv1.StoredResponse{Body: []byte("sent")}, nil
		}
		clients.MarkSideEffect(ctx) // from here on, a failure means "maybe sent"
		sent++
		if sent == 1 {
			return nil, status.Error(codes.Unavailable, "audit log unavailable")
		}
		return &idempotencyv1.StoredResponse{Body: []byte("sent")}, nil
	}
	for range 2 {
		res, err := c.Once(context.Background(), "mail", "welcome-user-7", nil, sendWelcome)
		if err != nil {
			fmt.Println("first try:", status.Code(err))
			continue
		}
		fmt.Printf("second try: %s, mails sent: %d\n", res.Response.GetBody(), sent)
	}
	// Output:
	// first try: Unavailable
	// checked the mail provider: already sent
	// second try: sent, mails sent: 1
}

// chargesTable stands for the service's own table of charges with
// UNIQUE (idem_key, generation): the database refuses a second charge for
// one generation of one idempotency key. In SQL:
//
//	INSERT INTO charges (idem_key, generation, account, amount_cents)
//	VALUES ($1, $2, $3, $4)
//	ON CONFLICT (idem_key, generation) DO NOTHING
//	RETURNING id
type chargesTable struct {
	mu   sync.Mutex
	rows map[string]string // "key/generation" → charge id
}

// insert books a charge unless the fence (key, generation) already holds
// one; it returns the charge id and whether this call booked it.
func (t *chargesTable) insert(key string, generation int32) (string, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	fence := fmt.Sprintf("%s/%d", key, generation)
	if id, ok := t.rows[fence]; ok {
		return id, false
	}
	id := fmt.Sprintf("ch_%d", len(t.rows)+1)
	t.rows[fence] = id
	return id, true
}

// count returns how many charges were booked.
func (t *chargesTable) count() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.rows)
}

// fencedPayments books charges through chargesTable, fenced by the lease.
type fencedPayments struct {
	projectsv1.UnimplementedProjectsServiceServer
	charges *chargesTable
	calls   atomic.Int32
}

func (s *fencedPayments) Charge(ctx context.Context, req *projectsv1.ChargeRequest) (*projectsv1.ChargeResponse, error) {
	n := s.calls.Add(1)
	lease, _ := clients.LeaseFrom(ctx)
	clients.MarkSideEffect(ctx)
	id, booked := s.charges.insert(lease.Key, lease.Generation)
	fmt.Printf("attempt %d (after %v): charge %s, booked now: %v\n", lease.Attempt, lease.Previous, id, booked)
	if n == 1 {
		// The charge is booked, then the reply to the bank's webhook times
		// out: the attempt ends UNKNOWN.
		return nil, status.Error(codes.DeadlineExceeded, "bank webhook timed out")
	}
	return &projectsv1.ChargeResponse{ChargeId: id, AmountCents: req.GetAmountCents(), Currency: req.GetCurrency()}, nil
}

// A handler fences its own write with the lease: the charge row carries
// (key, generation) under a unique constraint, so a retry of an attempt
// that may have charged finds the charge instead of booking a second one,
// even where the coordinator alone could not tell.
func ExampleLeaseFrom() {
	conn, stop := exampleCoordinator("ExampleLeaseFrom")
	defer stop()
	idem := clients.New(conn)
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(clients.UnaryServerInterceptor(idem, clients.WithoutPrincipal())))
	payments := &fencedPayments{charges: &chargesTable{rows: map[string]string{}}}
	projectsv1.RegisterProjectsServiceServer(srv, payments)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Println(err)
		return
	}
	go func() { _ = srv.Serve(lis) }()
	defer idem.Shutdown(context.Background())
	defer srv.Stop()

	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cc.Close()
	api := projectsv1.NewProjectsServiceClient(cc)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "idempotency-key", "order-7")
	req := &projectsv1.ChargeRequest{AccountId: "acct_1", AmountCents: 1250, Currency: "EUR"}
	for range 3 {
		resp, err := api.Charge(ctx, req)
		if err != nil {
			fmt.Println("caller got", status.Code(err))
			continue
		}
		fmt.Println("caller got", resp.GetChargeId())
	}
	fmt.Println("charges booked:", payments.charges.count())
	// Output:
	// attempt 1 (after STATE_UNSPECIFIED): charge ch_1, booked now: true
	// caller got DeadlineExceeded
	// attempt 2 (after STATE_UNKNOWN): charge ch_1, booked now: false
	// caller got ch_1
	// caller got ch_1
	// charges booked: 1
}
