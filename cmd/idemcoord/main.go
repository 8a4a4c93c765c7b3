// Command idemcoord is the idempotency coordinator server. It serves the
// idempotency.v1 gRPC API over a PostgreSQL database.
//
// Every flag can also be set through the environment variable named in its
// help text. On SIGTERM or SIGINT it stops taking calls, finishes those in
// flight, and exits 0.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/net/netutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/server"
)

// defaultGCPercent is the garbage collector's target when GOGC is not set:
// the coordinator's live heap is small (tens of MB at 256 callers) and each
// call leaves short-lived garbage, so collecting when the heap has grown by
// 4x instead of Go's default 2x (GOGC=100) cuts the collector's share of
// the CPU for a few tens of MB more memory (docs/performance.md). A GOGC in
// the environment wins.
const defaultGCPercent = 400

// defaultGRPCMaxConns is the default of --grpc-max-connections: a
// connection costs the gRPC listener about 40 KiB besides its calls (500
// connections raised the resident memory by 18 MiB), so this many cost
// about 40 MiB, while a client process keeps one connection per
// coordinator.
const defaultGRPCMaxConns = 1024

// defaultHTTPMaxConns is the default of --http-max-connections: a
// connection costs the HTTP listener about 25 KiB before any body, so
// this many cost about 25 MiB, while its clients (scrapers, probes, a
// proxy in front of the HTTP API) keep a few connections each, and idle
// ones are closed after 2 minutes.
const defaultHTTPMaxConns = 1024

// version and commit name the build; `make image` sets them with
// -ldflags "-X main.version=… -X main.commit=…", and --version prints them.
var version, commit = "dev", "unknown"

func main() {
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(defaultGCPercent)
	}
	if len(os.Args) == 2 && (os.Args[1] == "--version" || os.Args[1] == "-version") {
		fmt.Printf("idemcoord %s (commit %s)\n", version, commit)
		return
	}
	if err := run(os.Args[1:], os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "idemcoord:", err)
		os.Exit(1)
	}
}

type config struct {
	listen          string
	httpListen      string
	databaseURL     string
	notifyURL       string
	notifications   string
	configPath      string
	tlsCert         string
	tlsKey          string
	tlsClientCA     string
	allowNoAuth     bool
	logFormat       string
	logLevel        string
	otlpEndpoint    string
	metricsToken    string
	shutdownTimeout time.Duration
	maxStreams      uint
	grpcMaxConns    uint
	grpcReadTimeout time.Duration
	grpcMaxBuffered int64
	grpcClientBuf   int64
	httpMaxConns    uint
	console         bool
	httpMaxBody     int64
	httpReadTimeout time.Duration
	httpMaxBuffered int64
	httpClientBuf   int64
	httpHosts       []string
	slowCall        time.Duration
	batchWorkers    uint
}

// env returns the value of the environment variable name, or def.
func env(name, def string) string {
	if v, ok := os.LookupEnv(name); ok {
		return v
	}
	return def
}

func parseFlags(args []string) (*config, error) {
	c := &config{}
	var envs envValues
	fs := flag.NewFlagSet("idemcoord", flag.ContinueOnError)
	fs.StringVar(&c.listen, "listen", env("IDEMCOORD_LISTEN", "127.0.0.1:50051"), "gRPC listen address (IDEMCOORD_LISTEN)")
	fs.StringVar(&c.httpListen, "http-listen", env("IDEMCOORD_HTTP_LISTEN", "127.0.0.1:9090"), "HTTP address for /metrics, /healthz, /readyz (IDEMCOORD_HTTP_LISTEN)")
	fs.StringVar(&c.databaseURL, "database-url", env("DATABASE_URL", ""), "PostgreSQL URL (DATABASE_URL)")
	fs.StringVar(&c.notifyURL, "notify-database-url", env("IDEMCOORD_NOTIFY_DATABASE_URL", ""), "direct PostgreSQL URL for the LISTEN connection and migrations, when --database-url goes through a transaction-pooling PgBouncer (IDEMCOORD_NOTIFY_DATABASE_URL)")
	fs.StringVar(&c.notifications, "notifications", env("IDEMCOORD_NOTIFICATIONS", "on"), "on: a LISTEN connection wakes waiting Begins and keeps the replay cache; off: no LISTEN, no replay cache, waits poll (IDEMCOORD_NOTIFICATIONS)")
	fs.StringVar(&c.configPath, "config", env("IDEMCOORD_CONFIG", ""), "optional YAML policy file (IDEMCOORD_CONFIG)")
	fs.StringVar(&c.tlsCert, "tls-cert", env("IDEMCOORD_TLS_CERT", ""), "TLS certificate file (IDEMCOORD_TLS_CERT)")
	fs.StringVar(&c.tlsKey, "tls-key", env("IDEMCOORD_TLS_KEY", ""), "TLS key file (IDEMCOORD_TLS_KEY)")
	fs.StringVar(&c.tlsClientCA, "tls-client-ca", env("IDEMCOORD_TLS_CLIENT_CA", ""), "CA file for client certificates (IDEMCOORD_TLS_CLIENT_CA)")
	fs.StringVar(&c.logFormat, "log-format", env("IDEMCOORD_LOG_FORMAT", "text"), "log format: text or json (IDEMCOORD_LOG_FORMAT)")
	fs.StringVar(&c.logLevel, "log-level", env("IDEMCOORD_LOG_LEVEL", "info"), "log level: debug, info, warn, error (IDEMCOORD_LOG_LEVEL)")
	fs.BoolVar(&c.allowNoAuth, "insecure-allow-no-auth", envs.bool("IDEMCOORD_INSECURE_ALLOW_NO_AUTH"), "serve without authentication on a non-loopback address (IDEMCOORD_INSECURE_ALLOW_NO_AUTH)")
	fs.StringVar(&c.otlpEndpoint, "otlp-endpoint", env("OTEL_EXPORTER_OTLP_ENDPOINT", ""), "OTLP/gRPC collector for traces, e.g. http://127.0.0.1:4317; empty disables tracing (OTEL_EXPORTER_OTLP_ENDPOINT)")
	fs.StringVar(&c.metricsToken, "metrics-token-file", env("IDEMCOORD_METRICS_TOKEN_FILE", ""), "file holding a bearer token that /metrics scrapes must send; empty leaves /metrics open (IDEMCOORD_METRICS_TOKEN_FILE)")
	fs.UintVar(&c.maxStreams, "max-concurrent-streams", envs.uint("IDEMCOORD_MAX_CONCURRENT_STREAMS", 1000),
		"most calls in flight on one client connection; more wait for a free slot (IDEMCOORD_MAX_CONCURRENT_STREAMS)")
	fs.UintVar(&c.grpcMaxConns, "grpc-max-connections", envs.uint("IDEMCOORD_GRPC_MAX_CONNECTIONS", defaultGRPCMaxConns),
		"most client connections --listen holds at once; more wait to be accepted; 0: no limit (IDEMCOORD_GRPC_MAX_CONNECTIONS)")
	grpcReadTimeout := fs.String("grpc-read-timeout", env("IDEMCOORD_GRPC_READ_TIMEOUT", server.DefaultGRPCReadTimeout.String()),
		"how long a call on --listen may take to send its request message after its headers (IDEMCOORD_GRPC_READ_TIMEOUT)")
	grpcMaxBuffered := fs.String("grpc-max-buffered-bytes", env("IDEMCOORD_GRPC_MAX_BUFFERED_BYTES", "0"),
		"most request message bytes --listen holds at once, all calls together, each call charged 8 MiB (a 4 MiB message as read and decoded) until its message is read; "+
			"a call past it waits up to 1s, then fails RESOURCE_EXHAUSTED; 0: 16 calls, 129 MiB (IDEMCOORD_GRPC_MAX_BUFFERED_BYTES)")
	grpcPerClient := fs.String("grpc-max-buffered-bytes-per-client", env("IDEMCOORD_GRPC_MAX_BUFFERED_BYTES_PER_CLIENT", "0"),
		"most of --grpc-max-buffered-bytes that one client (a tenant while auth is on, else a remote IP address, IPv6 /64) holds at once; "+
			"0: an eighth of the budget, at least one call (IDEMCOORD_GRPC_MAX_BUFFERED_BYTES_PER_CLIENT)")
	fs.UintVar(&c.httpMaxConns, "http-max-connections", envs.uint("IDEMCOORD_HTTP_MAX_CONNECTIONS", defaultHTTPMaxConns),
		"most client connections --http-listen holds at once; more wait to be accepted; 0: no limit (IDEMCOORD_HTTP_MAX_CONNECTIONS)")
	fs.BoolVar(&c.console, "console", envs.bool("IDEMCOORD_CONSOLE"), "serve the operator web console under /console/ on --http-listen (IDEMCOORD_CONSOLE)")
	fs.DurationVar(&c.shutdownTimeout, "shutdown-timeout", 30*time.Second, "how long SIGTERM waits for calls in flight")
	maxBody := fs.String("http-max-body-bytes", env("IDEMCOORD_HTTP_MAX_BODY_BYTES", strconv.Itoa(server.DefaultHTTPMaxBodyBytes)),
		"largest request body on --http-listen, counted after gzip decompression; larger gets 413 (IDEMCOORD_HTTP_MAX_BODY_BYTES)")
	maxBuffered := fs.String("http-max-buffered-bytes", env("IDEMCOORD_HTTP_MAX_BUFFERED_BYTES", "0"),
		"most request body bytes --http-listen holds at once, all requests together, counted after gzip decompression; a request past it gets 503 with Retry-After; "+
			"0: 128 MiB or 16 times --http-max-body-bytes, whichever is larger (IDEMCOORD_HTTP_MAX_BUFFERED_BYTES)")
	perClient := fs.String("http-max-buffered-bytes-per-client", env("IDEMCOORD_HTTP_MAX_BUFFERED_BYTES_PER_CLIENT", "0"),
		"most of --http-max-buffered-bytes that one client (remote IP address, IPv6 /64; behind a proxy, the proxy) holds at once; past it a request gets 429 with Retry-After; "+
			"0: an eighth of the budget, at least --http-max-body-bytes (IDEMCOORD_HTTP_MAX_BUFFERED_BYTES_PER_CLIENT)")
	readTimeout := fs.String("http-read-timeout", env("IDEMCOORD_HTTP_READ_TIMEOUT", server.DefaultHTTPReadTimeout.String()),
		"how long --http-listen waits for a request's headers and body (IDEMCOORD_HTTP_READ_TIMEOUT)")
	fs.UintVar(&c.batchWorkers, "batch-workers", envs.uint("IDEMCOORD_BATCH_WORKERS", ledger.DefaultBatchWorkers),
		"how many coalesced rounds (the Begins and Completes queued when one starts, written in one transaction) run at once; fewer make larger rounds, cheaper for PostgreSQL per call (IDEMCOORD_BATCH_WORKERS)")
	slowCall := fs.String("slow-call-threshold", env("IDEMCOORD_SLOW_CALL_THRESHOLD", server.DefaultSlowCallThreshold.String()),
		"a successful call is logged at info level only when it takes at least this long (at debug level otherwise); failed calls are always logged; 0s logs every call at info level (IDEMCOORD_SLOW_CALL_THRESHOLD)")
	hosts := fs.String("http-allowed-hosts", env("IDEMCOORD_HTTP_ALLOWED_HOSTS", ""),
		"comma-separated host names or addresses that a request's Host may give on --http-listen while auth is off, besides loopback ones (IDEMCOORD_HTTP_ALLOWED_HOSTS)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if len(envs.errs) > 0 {
		return nil, errors.Join(envs.errs...)
	}
	var err error
	if c.httpMaxBody, err = strconv.ParseInt(*maxBody, 10, 64); err != nil || c.httpMaxBody < 1 || c.httpMaxBody > math.MaxUint32 {
		return nil, fmt.Errorf("--http-max-body-bytes %q: want a number of bytes from 1 to %d", *maxBody, uint32(math.MaxUint32))
	}
	bodyMin := fmt.Sprintf("--http-max-body-bytes (%d)", c.httpMaxBody)
	callMin := fmt.Sprintf("one call's charge (%d)", server.GRPCBufferedCallBytes)
	for _, b := range []struct {
		flag, value string
		min         int64
		minWhat     string
		into        *int64
	}{
		{"--http-max-buffered-bytes", *maxBuffered, c.httpMaxBody, bodyMin, &c.httpMaxBuffered},
		{"--http-max-buffered-bytes-per-client", *perClient, c.httpMaxBody, bodyMin, &c.httpClientBuf},
		{"--grpc-max-buffered-bytes", *grpcMaxBuffered, server.GRPCBufferedCallBytes, callMin, &c.grpcMaxBuffered},
		{"--grpc-max-buffered-bytes-per-client", *grpcPerClient, server.GRPCBufferedCallBytes, callMin, &c.grpcClientBuf},
	} {
		// A budget is a number of bytes, at least min, or 0 for its default.
		n, err := strconv.ParseInt(b.value, 10, 64)
		if err != nil || n < 0 || (n > 0 && n < b.min) {
			return nil, fmt.Errorf("%s %q: want a number of bytes, at least %s, or 0 for the default", b.flag, b.value, b.minWhat)
		}
		*b.into = n
	}
	if c.httpReadTimeout, err = time.ParseDuration(*readTimeout); err != nil || c.httpReadTimeout <= 0 {
		return nil, fmt.Errorf("--http-read-timeout %q: want a duration such as 30s", *readTimeout)
	}
	if c.grpcReadTimeout, err = time.ParseDuration(*grpcReadTimeout); err != nil || c.grpcReadTimeout <= 0 {
		return nil, fmt.Errorf("--grpc-read-timeout %q: want a duration such as 30s", *grpcReadTimeout)
	}
	if c.slowCall, err = time.ParseDuration(*slowCall); err != nil || c.slowCall < 0 {
		return nil, fmt.Errorf("--slow-call-threshold %q: want a duration such as 250ms, or 0s to log every call", *slowCall)
	}
	for h := range strings.SplitSeq(*hosts, ",") {
		if h = strings.TrimSpace(h); h != "" {
			c.httpHosts = append(c.httpHosts, h)
		}
	}
	if c.batchWorkers < 1 || c.batchWorkers > 64 {
		return nil, fmt.Errorf("--batch-workers %d: want 1 to 64", c.batchWorkers)
	}
	if c.maxStreams == 0 || c.maxStreams > math.MaxUint32 {
		return nil, fmt.Errorf("--max-concurrent-streams %d: want 1 to %d", c.maxStreams, uint32(math.MaxUint32))
	}
	if c.databaseURL == "" {
		return nil, errors.New("no database: set --database-url or DATABASE_URL (or use `make run`, which starts a local PostgreSQL)")
	}
	if c.notifications != "on" && c.notifications != "off" {
		return nil, fmt.Errorf("--notifications %q: want on or off", c.notifications)
	}
	if c.notifications == "off" && c.notifyURL != "" {
		return nil, errors.New("--notify-database-url is for the LISTEN connection, which --notifications=off turns off")
	}
	if (c.tlsCert == "") != (c.tlsKey == "") {
		return nil, errors.New("--tls-cert and --tls-key go together")
	}
	if c.tlsClientCA != "" && c.tlsCert == "" {
		return nil, errors.New("--tls-client-ca needs --tls-cert and --tls-key")
	}
	return c, nil
}

// checkExposure refuses to serve without auth on an address others can
// reach, gRPC (--listen) or HTTP (--http-listen, which serves the API too),
// unless the operator said so.
func checkExposure(c *config, authEnabled bool) error {
	if authEnabled || c.allowNoAuth {
		return nil
	}
	var errs []error
	for _, l := range []struct{ flag, addr string }{{"--listen", c.listen}, {"--http-listen", c.httpListen}} {
		if !isLoopback(l.addr) {
			errs = append(errs, fmt.Errorf("%s %s is not a loopback address and auth is disabled (no tenants in the config): "+
				"anyone who can reach it could read, replay and forget every record; configure tenants or pass --insecure-allow-no-auth", l.flag, l.addr))
		}
	}
	return errors.Join(errs...)
}

// tlsCredentials builds the server's TLS credentials from the flags, or
// returns nil without TLS. With a client CA, client certificates are
// verified when given (callers may still use bearer tokens).
func tlsCredentials(c *config) (credentials.TransportCredentials, error) {
	cfg, err := tlsConfig(c)
	if cfg == nil || err != nil {
		return nil, err
	}
	return credentials.NewTLS(cfg), nil
}

// tlsConfig is the server's TLS configuration from the flags, or nil
// without TLS.
func tlsConfig(c *config) (*tls.Config, error) {
	if c.tlsCert == "" {
		return nil, nil
	}
	cert, err := tls.LoadX509KeyPair(c.tlsCert, c.tlsKey)
	if err != nil {
		return nil, fmt.Errorf("--tls-cert/--tls-key: %w", err)
	}
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if c.tlsClientCA != "" {
		pem, err := os.ReadFile(c.tlsClientCA) //nolint:gosec // the operator names this file (flag, environment or config file); reading it is the point
		if err != nil {
			return nil, fmt.Errorf("--tls-client-ca: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--tls-client-ca %s: no PEM certificate in it", c.tlsClientCA)
		}
		cfg.ClientCAs = pool
		cfg.ClientAuth = tls.VerifyClientCertIfGiven
	}
	return cfg, nil
}

// readMetricsToken reads the /metrics bearer token from path (surrounding
// white space removed).
func readMetricsToken(path string) (string, error) {
	data, err := os.ReadFile(path) //nolint:gosec // the operator names this file (flag, environment or config file); reading it is the point
	if err != nil {
		return "", fmt.Errorf("--metrics-token-file: %w", err)
	}
	token := strings.TrimSpace(string(data))
	if token == "" {
		return "", fmt.Errorf("--metrics-token-file %s is empty", path)
	}
	return token, nil
}

// envValues reads the environment variables behind the boolean and
// numeric flags, and remembers each that is set but is not a value of
// its kind, so that parseFlags refuses it instead of using the default.
type envValues struct{ errs []error }

// uint returns the environment variable name as a number, or def when it
// is unset (or not a number, which parseFlags then refuses).
func (e *envValues) uint(name string, def uint) uint {
	s, ok := os.LookupEnv(name)
	if !ok || s == "" {
		return def
	}
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		e.errs = append(e.errs, fmt.Errorf("%s=%q: want a whole number", name, s))
		return def
	}
	return uint(v)
}

// bool returns the environment variable name as a boolean, false when it
// is unset (or not a boolean, which parseFlags then refuses).
func (e *envValues) bool(name string) bool {
	s, ok := os.LookupEnv(name)
	if !ok || s == "" {
		return false
	}
	v, err := strconv.ParseBool(s)
	if err != nil {
		e.errs = append(e.errs, fmt.Errorf("%s=%q: want true or false (or 1 or 0)", name, s))
		return false
	}
	return v
}

// isLoopback reports whether a listen address binds only to loopback.
func isLoopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

func newLogger(c *config, w *os.File) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(c.logLevel)); err != nil {
		return nil, fmt.Errorf("--log-level %q: %w", c.logLevel, err)
	}
	hopts := &slog.HandlerOptions{Level: level}
	switch c.logFormat {
	case "text":
		return slog.New(slog.NewTextHandler(w, hopts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, hopts)), nil
	}
	return nil, fmt.Errorf("--log-format %q: want text or json", c.logFormat)
}

func run(args []string, logOut *os.File) error {
	c, err := parseFlags(args)
	if err != nil {
		return err
	}
	hup := notifyHangup()
	defer signal.Stop(hup)
	logger, err := newLogger(c, logOut)
	if err != nil {
		return err
	}
	policies := server.DefaultPolicies()
	if c.configPath != "" {
		if policies, err = server.LoadPolicies(c.configPath); err != nil {
			return err
		}
	}

	if err := checkExposure(c, policies.AuthEnabled()); err != nil {
		return err
	}
	if err := checkConsoleExposure(c, policies.AuthEnabled()); err != nil {
		return err
	}
	creds, err := tlsCredentials(c)
	if err != nil {
		return err
	}
	var metricsToken string
	if c.metricsToken != "" {
		if metricsToken, err = readMetricsToken(c.metricsToken); err != nil {
			return err
		}
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	logger.Info("applying migrations")
	// Migrations hold a session-level advisory lock, which a transaction
	// pooler would not keep: they take the direct URL when there is one.
	migrateURL := c.databaseURL
	if c.notifyURL != "" {
		migrateURL = c.notifyURL
	}
	if err := migrateWithRetry(ctx, logger, migrateURL); err != nil {
		return err
	}
	lopts := []ledger.Option{ledger.WithLogger(logger), ledger.WithBatchWorkers(int(c.batchWorkers))}
	switch {
	case c.notifications == "off":
		lopts = append(lopts, ledger.WithoutNotifications())
		logger.Info("notifications off: no replay cache, waiting Begins poll")
	case c.notifyURL != "":
		lopts = append(lopts, ledger.WithNotifyDatabaseURL(c.notifyURL))
	}
	if k := policies.Keyring(); k != nil {
		lopts = append(lopts, ledger.WithKeyring(k))
		logger.Info("records are encrypted at rest", "active_key", k.ActiveKeyID(), "accept_legacy_rows", k.AcceptsLegacyRows())
	}
	store, err := ledger.Open(ctx, c.databaseURL, lopts...)
	if err != nil {
		return err
	}
	defer store.Close()
	if k := policies.Keyring(); k != nil {
		go checkLegacyRows(ctx, logger, store, k)
	}

	sopts := []server.Option{server.WithPolicies(policies), server.WithLogger(logger),
		server.WithGRPCOptions(grpc.MaxConcurrentStreams(uint32(c.maxStreams))), server.WithGRPCReadTimeout(c.grpcReadTimeout), //nolint:gosec // parseFlags refuses --max-concurrent-streams above MaxUint32
		server.WithGRPCMaxBufferedBytes(c.grpcMaxBuffered), server.WithGRPCMaxBufferedBytesPerClient(c.grpcClientBuf),
		server.WithHTTPMaxBodyBytes(c.httpMaxBody), server.WithHTTPMaxBufferedBytes(c.httpMaxBuffered), server.WithHTTPMaxBufferedBytesPerClient(c.httpClientBuf), server.WithHTTPReadTimeout(c.httpReadTimeout), server.WithHTTPAllowedHosts(c.httpHosts...),
		server.WithSlowCallThreshold(c.slowCall)}
	if metricsToken != "" {
		sopts = append(sopts, server.WithMetricsToken(metricsToken))
	}
	if creds != nil {
		sopts = append(sopts, server.WithGRPCOptions(grpc.Creds(creds)))
	}
	tracing, stopTracing, err := setupTracing(ctx, c.otlpEndpoint)
	if err != nil {
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = stopTracing(sctx)
	}()
	if tracing != nil {
		sopts = append(sopts, server.WithGRPCOptions(tracing))
		logger.Info("tracing calls over OTLP", "endpoint", c.otlpEndpoint)
	}
	srv, err := server.New(store, append(sopts, consoleServerOptions(c)...)...)
	if err != nil {
		return err
	}
	setMemoryLimit(logger, srv)
	lis, err := net.Listen("tcp", c.listen)
	if err != nil {
		return err
	}
	if c.grpcMaxConns > 0 {
		lis = netutil.LimitListener(lis, int(c.grpcMaxConns))
	}
	if !policies.AuthEnabled() {
		logger.Warn("auth disabled (no tenants in the config): every caller is tenant \"default\"; "+
			"the HTTP listener answers only requests whose Host is loopback or in --http-allowed-hosts",
			"listen", lis.Addr().String(), "http_allowed_hosts", strings.Join(c.httpHosts, ","))
	}
	go srv.RunReaper(ctx)
	go watchConfig(ctx, logger, c.configPath, hup, srv, reloadCheck(c))
	hlis, err := net.Listen("tcp", c.httpListen)
	if err != nil {
		return err
	}
	if c.httpMaxConns > 0 {
		hlis = netutil.LimitListener(hlis, int(c.httpMaxConns))
	}
	httpHandler := srv.HTTPHandler()
	if c.console {
		if httpHandler, hlis, err = mountConsole(ctx, c, logger, srv, store, policies.AuthEnabled(), hlis); err != nil {
			return err
		}
	} else if c.tlsCert != "" {
		// The HTTP listener serves the API too (HTTP/JSON): with TLS on it
		// serves HTTPS with the same certificates (as with the console), so
		// client certificates authenticate there and tokens never travel in
		// clear.
		cfg, err := tlsConfig(c)
		if err != nil {
			return err
		}
		hlis = tls.NewListener(hlis, cfg)
	}
	httpSrv := srv.NewHTTPServer(httpHandler)
	logger.Info("serving", "grpc", lis.Addr().String(), "http", hlis.Addr().String())

	serveErr := make(chan error, 2)
	go func() { serveErr <- srv.Serve(lis) }()
	go func() {
		if err := httpSrv.Serve(hlis); !errors.Is(err, http.ErrServerClosed) {
			serveErr <- err
		}
	}()
	select {
	case err := <-serveErr:
		return err
	case <-ctx.Done():
	}
	logger.Info("shutting down: finishing calls in flight", "timeout", c.shutdownTimeout)
	sctx, cancel := context.WithTimeout(context.Background(), c.shutdownTimeout)
	defer cancel()
	srv.Shutdown(sctx)
	_ = httpSrv.Shutdown(sctx)
	logger.Info("stopped")
	return nil
}

// checkLegacyRows converts the records not yet in the current sealed form
// when the keyring accepts legacy rows, and otherwise warns about them:
// each answers DATA_LOSS until it is converted.
func checkLegacyRows(ctx context.Context, logger *slog.Logger, store *ledger.Store, k *ledger.Keyring) {
	if k.AcceptsLegacyRows() {
		converted, skipped, err := store.ConvertLegacyRows(ctx, 500)
		if err != nil {
			logger.Error("converting legacy rows failed; restart to try again", "converted", converted, "err", err)
			return
		}
		n, err := store.CountLegacyRows(ctx)
		logger.Warn("legacy rows converted to the current sealed form; remove encryption.accept_legacy_rows once none remain",
			"converted", converted, "unreadable", skipped, "remaining", n, "err", err)
		return
	}
	n, err := store.CountLegacyRows(ctx)
	switch {
	case err != nil:
		logger.Warn("cannot count legacy rows", "err", err)
	case n > 0:
		logger.Error("records stored in clear or in the legacy sealed form answer DATA_LOSS (RECORD_UNREADABLE) "+
			"until converted: set encryption.accept_legacy_rows: true and restart once to convert them", "rows", n)
	}
}

// migrateWithRetry applies migrations, waiting for the database to come up
// (for instance while it is still starting) until ctx ends.
func migrateWithRetry(ctx context.Context, logger *slog.Logger, url string) error {
	backoff := 200 * time.Millisecond
	for {
		err := ledger.Migrate(ctx, url)
		if err == nil || !errors.Is(err, ledger.ErrUnavailable) {
			return err
		}
		logger.Warn("database not reachable yet; retrying", "err", err, "in", backoff)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, 5*time.Second)
	}
}
