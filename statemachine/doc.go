// Package statemachine is the domain core of idemcoord: the states of an
// idempotency record, the events that change them, and Next, the pure
// function that decides what an event does to a record under a policy at a
// given time.
//
// It imports only the standard library. It knows nothing of SQL, gRPC or
// clocks: the caller passes "now", the record as stored, and (for Begin) the
// token a new acquisition would get, and applies the Decision it gets back.
package statemachine
