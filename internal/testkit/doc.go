// Package testkit holds the small test helpers that tests of several
// packages share: a log destination safe for concurrent use (LogBuffer),
// a throwaway certificate authority (CA) and a program run as a process that
// a test kills (Service). Only tests import it.
//
// It imports only the standard library: a helper that needs the project's
// packages (a whole coordinator, a database) lives in internal/coordtest
// or internal/pgtest.
package testkit
