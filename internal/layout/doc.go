// Package layout holds TestImports, which checks every package's imports
// against the layout table of the design ("may import"): arrows only point
// down (server → ledger → statemachine), statemachine imports only the
// standard library, clients and console never reach ledger or server, and
// no pgx type leaks above ledger. It has no code of its own.
package layout
