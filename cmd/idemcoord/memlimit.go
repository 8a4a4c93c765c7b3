package main

import (
	"log/slog"
	"os"
	"runtime/debug"

	"github.com/idemcoord/idemcoord/server"
)

// memoryLimitBase is the part of the default Go memory limit that is not
// the listeners' buffered requests: the coordinator's own live heap (tens
// of MB at 256 callers) and its connections.
const memoryLimitBase = 256 << 20

// defaultMemoryLimit is the Go memory limit (the heap size past which the
// garbage collector runs however little the heap grew since it last ran)
// when GOMEMLIMIT is not set: memoryLimitBase plus twice what the HTTP
// listener may hold in request bodies and the gRPC listener in request
// messages. With GOGC at 400 alone, garbage could pile up to 5 times the
// live heap: when floods of requests fill the budgets, 6 times the
// budgets in all.
func defaultMemoryLimit(srv *server.Server) int64 {
	return memoryLimitBase + 2*(srv.HTTPMaxBufferedBytes()+srv.GRPCMaxBufferedBytes())
}

// setMemoryLimit sets the Go memory limit to defaultMemoryLimit unless
// GOMEMLIMIT is set (the operator's limit, or off, wins), and logs the
// limit in force.
func setMemoryLimit(logger *slog.Logger, srv *server.Server) {
	if os.Getenv("GOMEMLIMIT") == "" {
		debug.SetMemoryLimit(defaultMemoryLimit(srv))
	}
	logger.Info("Go memory limit", "bytes", debug.SetMemoryLimit(-1), "from_GOMEMLIMIT", os.Getenv("GOMEMLIMIT") != "")
}
