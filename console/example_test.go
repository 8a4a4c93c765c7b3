package console_test

import (
	"context"
	"log/slog"
	"net/http"
	"time"

	"github.com/idemcoord/idemcoord/console"
	"github.com/idemcoord/idemcoord/server"
)

// Mount the console next to the server's /metrics, as idemcoord --console
// does: it calls the Admin service in process, as each request's operator,
// keeps sign-in sessions in a SessionStore, and charts the server's counters.
func ExampleNew() { //nolint:testableexamples // it needs a running server; compiled, not run
	var srv *server.Server            // from server.New
	var sessions console.SessionStore // idemcoord keeps them in PostgreSQL (ledger)
	ctx := context.Background()

	con := console.New(srv.AdminConn(),
		console.WithLogger(slog.Default()),
		console.WithSessions(sessions), // for operators who sign in with a token
		console.WithCounters(func() console.Counters {
			t := srv.CounterTotals()
			return console.Counters{Acquired: t.Acquired, Replayed: t.Replayed, InProgress: t.InProgress, UnknownEntered: t.UnknownEntered}
		}))
	go con.Run(ctx) // samples the counters once a minute for the chart

	mux := http.NewServeMux()
	mux.Handle("/", srv.HTTPHandler())
	mux.Handle(console.Prefix, con)
	// Plain HTTP on loopback only; elsewhere serve TLS.
	hs := &http.Server{Addr: "127.0.0.1:9090", Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	_ = hs.ListenAndServe()
}
