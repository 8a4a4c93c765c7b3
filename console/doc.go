// Package console is idemcoord's operator web console: a few server-rendered
// pages to find the records that need a person (UNKNOWN ones above all) and
// to resolve or forget them from a browser.
//
// The console is a client of the idempotency.v1.Admin API, like idemctl: it
// is given a grpc.ClientConnInterface (the server binary passes
// server.(*Server).AdminConn, which runs the server's own interceptors in
// process) and sends each request's credentials with every call, so the
// server's authentication and tenant isolation decide what an operator may
// see and do. A browser signs in with a bearer token, which starts a
// server-side session in a SessionStore (WithSessions; the server binary
// keeps them in PostgreSQL, shared by every replica): the browser's
// HttpOnly, SameSite=Strict cookie (Secure over TLS) holds only a random
// session id, the store only the id's hash, and the token is stored sealed
// under a key derived from the id. Sessions end after 30 minutes idle or 12
// hours, at sign-out, and when the token stops authenticating. A browser
// may instead sign in with a client certificate that the HTTP listener
// verified, on every request. Every state-changing request must pass
// net/http's CrossOriginProtection and carry the CSRF token of its form.
//
// Pages are html/template files embedded in the binary; they need no
// JavaScript (the chart of the last hour is inline SVG drawn on the server).
//
// It may import the generated API (gen/...), clients and gRPC; never ledger
// or server.
package console
