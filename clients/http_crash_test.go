package clients_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/idemcoord/idemcoord/clients"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
)

// httpChildEnv holds, in a re-executed test binary, the coordinator address
// of the HTTP service it runs instead of the tests.
const httpChildEnv = "IDEMCOORD_TEST_HTTP_CHILD_COORDINATOR"

// runHTTPChild serves, behind HTTPMiddleware with a 1 s lease, a handler
// that marks its side effect and then never answers; it prints its address
// and serves until it is killed.
func runHTTPChild() int {
	conn, err := grpc.NewClient(os.Getenv(httpChildEnv), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	idem := clients.New(conn, clients.WithLease(time.Second))
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println(lis.Addr().String())
	h := clients.HTTPMiddleware(idem)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		clients.MarkSideEffect(r.Context())
		select {} // the side effect is under way when the process dies
	}))
	_ = http.Serve(lis, h)
	return 1
}

// A service killed (SIGKILL) while its handler runs leaves the key UNKNOWN
// once the lease lapses; the retry on another instance runs the handler as
// attempt 2 knowing that the first may have acted, and its response is the
// one stored.
func TestHTTPServiceKilledMidHandler(t *testing.T) {
	t.Parallel()
	coord := coordtest.Start(t, coordtest.Options{})
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	child := exec.Command(exe, "-test.run", "^$")
	child.Env = append(os.Environ(), httpChildEnv+"="+coord.Addr)
	out, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	child.Stderr = testLog{t}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = child.Process.Kill(); _ = child.Wait() })
	addr, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("child address: %v", err)
	}
	addr = strings.TrimSpace(addr)

	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() {
		req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/projects", strings.NewReader(`{"name":"Flower Shop"}`))
		req.Header.Set("Idempotency-Key", "crash-1")
		if resp, err := http.DefaultClient.Do(req); err == nil { // the child dies before it answers
			resp.Body.Close()
			t.Errorf("the killed service answered %d", resp.StatusCode)
		}
	})
	idem := clients.New(coord.Dial(t))
	state := func() idempotencyv1.State {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		res, err := idem.Lookup(ctx, &idempotencyv1.LookupRequest{Scope: "POST /projects", Key: "crash-1"})
		if err != nil && status.Code(err) != codes.NotFound {
			t.Errorf("Lookup: %v", err)
		}
		return res.GetRecord().GetState()
	}
	eventually(t, "the child's handler to hold the key", func() bool { return state() == idempotencyv1.State_STATE_IN_PROGRESS })
	if err := child.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the dead child's lease to lapse", func() bool { return state() == idempotencyv1.State_STATE_UNKNOWN })

	var seen clients.Lease
	f := startHTTP(t, httpSetup{coord: coord, opts: []clients.HTTPOption{clients.WithHTTPScope("")}, handler: func(w http.ResponseWriter, r *http.Request, n int32) {
		seen, _ = clients.LeaseFrom(r.Context())
		createProject(w, r, n)
	}})
	r := f.post(t, "crash-1", `{"name":"Flower Shop"}`)
	if r.status != http.StatusCreated || r.header.Get("Idempotency-Result") != "created" {
		t.Fatalf("retry after the crash: %v", r)
	}
	if seen.Attempt != 2 || seen.Previous != idempotencyv1.State_STATE_UNKNOWN || !seen.Uncertain {
		t.Fatalf("the retry's lease: %+v", seen)
	}
	if again := f.post(t, "crash-1", `{"name":"Flower Shop"}`); again.body != r.body || again.header.Get("Idempotency-Result") != "replayed" {
		t.Fatalf("after the retry: %v", again)
	}
}
