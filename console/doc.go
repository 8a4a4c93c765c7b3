// Package console is idemcoord's operator web console: a few server-rendered
// pages to find the records that need a person (UNKNOWN ones above all) and
// to resolve or forget them from a browser.
//
// The console is a client of the idempotency.v1.Admin API, like idemctl: it
// is given a grpc.ClientConnInterface (the server binary passes
// server.(*Server).AdminConn, which runs the server's own interceptors in
// process) and sends each request's credentials with every call, so the
// server's authentication and tenant isolation decide what an operator may
// see and do. A browser signs in with a bearer token, kept in an HttpOnly,
// SameSite=Strict cookie (Secure over TLS), or with a client certificate
// that the HTTP listener verified. Every state-changing request must pass
// net/http's CrossOriginProtection and carry the CSRF token of its form.
//
// Pages are html/template files embedded in the binary; they need no
// JavaScript (the chart of the last hour is inline SVG drawn on the server).
//
// It may import the generated API (gen/...), clients and gRPC; never ledger
// or server.
package console
