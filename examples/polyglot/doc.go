// Package polyglot holds the test that runs the Node (examples/node) and
// Python (examples/python) callers against a real coordinator, and
// idempotency.binpb, the FileDescriptorSet of proto/ and its imports that
// both callers load the API from (a test fails when it is stale). It has no
// Go code of its own.
package polyglot
