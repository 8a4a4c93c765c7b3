// Package polyglot holds the Go tests that run the test suites of the Node
// (clients/node) and Python (clients/python) client libraries against a
// real coordinator, so that `make test` runs them, and check that all three
// languages derive the same DedupKey and the same ErrorInfo reasons (from
// the API's enum ErrorReason). It has no Go code of its own.
//
// Each suite is skipped, naming the missing piece, where its runtime (or
// clients/node/node_modules, from `npm ci`) is absent, and fails instead
// when CI=true.
package polyglot
