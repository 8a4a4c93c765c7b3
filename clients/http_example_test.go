package clients_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/idemcoord/idemcoord/clients"
)

// One middleware makes a net/http service's POSTs idempotent: a retried
// request with the same Idempotency-Key gets the stored response, not a
// second project.
func ExampleHTTPMiddleware() {
	conn, stop := exampleCoordinator("ExampleHTTPMiddleware") // a connection to a running idemcoord
	defer stop()
	idem := clients.New(conn)
	defer idem.Shutdown(context.Background())

	projects := 0
	mux := http.NewServeMux()
	mux.HandleFunc("POST /projects", func(w http.ResponseWriter, r *http.Request) {
		projects++
		w.Header().Set("Location", fmt.Sprintf("/projects/prj_%d", projects))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "project prj_%d\n", projects)
	})
	// One client and no end users here: keys are shared on purpose. A service
	// with users folds each one into its keys with WithHTTPPrincipal.
	srv := httptest.NewServer(clients.HTTPMiddleware(idem, clients.WithoutHTTPPrincipal())(mux))
	defer srv.Close()

	// A client retries the same request with the same key.
	for range 3 {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/projects", strings.NewReader(`{"name":"Flower Shop"}`))
		req.Header.Set("Idempotency-Key", "7c1e5a0e-create")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			fmt.Println(err)
			return
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Println(resp.StatusCode, resp.Header.Get("Location"), resp.Header.Get("Idempotency-Result"), strings.TrimSpace(string(body)))
	}
	fmt.Println("projects created:", projects)
	// Output:
	// 201 /projects/prj_1 created project prj_1
	// 201 /projects/prj_1 replayed project prj_1
	// 201 /projects/prj_1 replayed project prj_1
	// projects created: 1
}
