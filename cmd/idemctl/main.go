// Command idemctl is the operator's CLI for a running idemcoord coordinator:
// it looks records up, lists them (for instance, with list --uncertain,
// every record that needs a decision: the UNKNOWN ones whose holder died
// and uncertain FAILED_RETRYABLE ones), resolves those after
// reconciliation, and forgets records.
//
//	idemctl [--addr HOST:PORT] [--token T] [--output table|json]
//	        [--tls-ca F] [--tls-cert F --tls-key F] [--tls-server-name N] [--tls] [--insecure]
//	        COMMAND ...
//
//	lookup SCOPE KEY
//	list [--state S] [--uncertain] [--scope GLOB] [--key-prefix P] [--checkpoint-phase P] [--limit N] [--archived]
//	resolve SCOPE KEY --as completed|retryable [--body-file F --schema-version V
//	        --content-type T --status-code N]
//	forget SCOPE KEY
//
// --addr defaults to $IDEMCOORD_ADDR, else 127.0.0.1:50051; --token to
// $IDEMCOORD_TOKEN (sent as "authorization: Bearer <token>").
//
// TLS is on when any of --tls-ca (verify the coordinator against this CA
// instead of the system roots), --tls-cert with --tls-key (a client
// certificate, for tenants that list its name in client_cert_names),
// --tls-server-name (the name to verify instead of the --addr host) or
// --tls (system roots) is given; each defaults to $IDEMCOORD_TLS_CA,
// $IDEMCOORD_TLS_CERT, $IDEMCOORD_TLS_KEY, $IDEMCOORD_TLS_SERVER_NAME and
// $IDEMCOORD_TLS. Without TLS, idemctl talks only to a loopback address,
// unless --insecure ($IDEMCOORD_INSECURE) says plaintext over the network
// is meant: the token would travel in clear. When a plaintext call fails
// against a coordinator that speaks TLS, or the other way round, the error
// says so. Flags may
// stand before or after the command and its arguments; "--" ends them.
// States are written as in the API without the STATE_ prefix, in any case
// (unknown, in_progress, …). It exits 0 on success, 1 when a call fails
// (printing the gRPC code, message and ErrorInfo reason), 2 on a usage
// error.
//
// It talks to the coordinator through the generated idempotency.v1 client
// only: the Coordinator service for lookup, the Admin service for the rest.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemcoord/idemcoord/clients"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Stdin, os.Stdout, os.Stderr, os.Getenv))
}

// Exit statuses.
const (
	exitOK    = 0
	exitError = 1
	exitUsage = 2
)

// defaultAddr is the coordinator's default listen address.
const defaultAddr = "127.0.0.1:50051"

// callTimeout bounds every command.
const callTimeout = 30 * time.Second

// maxPageSize is the largest page_size the Admin service accepts.
const maxPageSize = 1000

const usage = `usage: idemctl [--addr HOST:PORT] [--token T] [--output table|json] COMMAND ...

commands:
  lookup SCOPE KEY
        show a record as in effect now
  list [--state S] [--uncertain] [--scope GLOB] [--key-prefix P] [--checkpoint-phase P]
       [--limit N] [--archived]
        list records in (scope, key) order; S is a state without the STATE_
        prefix (unknown, in_progress, completed, failed_retryable,
        failed_replayable, expired) as in effect now: --state unknown
        includes IN_PROGRESS records whose lease lapsed, but not the
        uncertain failed_retryable ones, which need a decision too;
        --uncertain lists every record that needs a decision (unknown, and
        failed_retryable after an attempt that may have acted): the list
        to work through with resolve. GLOB matches scopes with * for any
        run of bytes, N is the most records to show (default 100, 0 for
        all); --archived lists the archive: UNKNOWN records the reaper
        moved out after their policy's unknown_retention, with the time it
        did; --checkpoint-phase lists the records whose last checkpoint
        (recovery point) has that phase
  resolve SCOPE KEY --as completed|retryable [--body-file F] [--schema-version V]
          [--content-type T] [--status-code N]
        end an UNKNOWN record after checking the outside world: as completed
        with the response read from F ("-" for standard input), replayed to
        later Begins, or as retryable, so the next Begin runs it again
  forget SCOPE KEY
        delete a record whatever its state

flags (before or after the command):
  --addr             coordinator address (default $IDEMCOORD_ADDR, else 127.0.0.1:50051)
  --token            bearer token (default $IDEMCOORD_TOKEN)
  --output           table or json (default table)
  --tls-ca           verify the coordinator's certificate against this CA file ($IDEMCOORD_TLS_CA)
  --tls-cert         client certificate file, with --tls-key ($IDEMCOORD_TLS_CERT)
  --tls-key          client certificate key file ($IDEMCOORD_TLS_KEY)
  --tls-server-name  name to verify in the coordinator's certificate ($IDEMCOORD_TLS_SERVER_NAME)
  --tls              use TLS with the system's roots ($IDEMCOORD_TLS)
  --insecure         allow plaintext to a non-loopback address ($IDEMCOORD_INSECURE)

Without TLS, idemctl talks only to loopback addresses unless --insecure is given.
`

// usageError is a mistake in the command line.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

// cli is one invocation: its global settings and streams.
type cli struct {
	addr, token, output string
	tls                 tlsSettings
	stdin               io.Reader
	stdout              io.Writer
}

// run runs idemctl with args (without the program name) and returns its exit
// status. getenv supplies IDEMCOORD_ADDR and IDEMCOORD_TOKEN.
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer, getenv func(string) string) int {
	c := &cli{addr: getenv("IDEMCOORD_ADDR"), token: getenv("IDEMCOORD_TOKEN"), output: "table",
		tls: tlsFromEnv(getenv), stdin: stdin, stdout: stdout}
	if c.addr == "" {
		c.addr = defaultAddr
	}
	err := c.dispatch(ctx, args)
	var ue *usageError
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, flag.ErrHelp):
		fmt.Fprint(stdout, usage)
		return exitOK
	case errors.As(err, &ue):
		fmt.Fprintf(stderr, "idemctl: %s\nrun 'idemctl help' for usage\n", ue.msg)
		return exitUsage
	default:
		fmt.Fprintf(stderr, "idemctl: %s\n", describe(err))
		return exitError
	}
}

// flags returns a flag set for command name with the global flags bound to
// c, so they may be given anywhere on the line.
func (c *cli) flags(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&c.addr, "addr", c.addr, "")
	fs.StringVar(&c.token, "token", c.token, "")
	fs.StringVar(&c.output, "output", c.output, "")
	c.tls.bind(fs)
	return fs
}

// parse parses args with fs, letting flags and positional arguments mix;
// everything after "--" is positional. It wants exactly nargs positional
// arguments, named by what for the error message.
func parse(fs *flag.FlagSet, args []string, what ...string) ([]string, error) {
	var pos, rest []string
	for i, a := range args {
		if a == "--" {
			args, rest = args[:i], args[i+1:]
			break
		}
	}
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, err
			}
			return nil, usagef("%s: %v", fs.Name(), err)
		}
		if fs.NArg() == 0 {
			break
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
	pos = append(pos, rest...)
	if len(pos) != len(what) {
		if len(what) == 0 {
			return nil, usagef("%s takes no arguments, got %q", fs.Name(), pos)
		}
		return nil, usagef("%s wants %s, got %d argument(s)", fs.Name(), strings.Join(what, " "), len(pos))
	}
	return pos, nil
}

func (c *cli) dispatch(ctx context.Context, args []string) error {
	// Global flags before the command.
	fs := c.flags("idemctl")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usagef("%v", err)
	}
	if fs.NArg() == 0 {
		return usagef("no command")
	}
	name, args := fs.Arg(0), fs.Args()[1:]
	var cmd func(context.Context, []string) error
	switch name {
	case "lookup":
		cmd = c.lookup
	case "list":
		cmd = c.list
	case "resolve":
		cmd = c.resolve
	case "forget":
		cmd = c.forget
	case "help":
		return flag.ErrHelp
	default:
		return usagef("unknown command %q", name)
	}
	return cmd(ctx, args)
}

// connect checks the global settings and dials the coordinator. The
// returned context carries the token and the call timeout.
func (c *cli) connect(ctx context.Context) (context.Context, *grpc.ClientConn, func(), error) {
	if c.output != "table" && c.output != "json" {
		return nil, nil, nil, usagef("--output must be table or json, got %q", c.output)
	}
	if c.addr == "" {
		return nil, nil, nil, usagef("--addr is empty")
	}
	creds, err := c.tls.credentials(c.addr)
	if err != nil {
		return nil, nil, nil, err
	}
	conn, err := grpc.NewClient(c.addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		return nil, nil, nil, fmt.Errorf("connect to %s: %w", c.addr, err)
	}
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	if c.token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+c.token)
	}
	return ctx, conn, func() { cancel(); _ = conn.Close() }, nil
}

func (c *cli) lookup(ctx context.Context, args []string) error {
	pos, err := parse(c.flags("lookup"), args, "SCOPE", "KEY")
	if err != nil {
		return err
	}
	return c.callRecord(ctx, func(ctx context.Context, conn *grpc.ClientConn) (*idempotencyv1.Record, error) {
		// The Coordinator through clients.Client, which sends the token
		// itself; ctx carries it for the Admin calls only.
		ctx = withoutToken(ctx)
		idem := clients.New(conn, clients.WithToken(c.token), clients.WithMaxAttempts(1))
		resp, err := idem.Lookup(ctx, &idempotencyv1.LookupRequest{Scope: pos[0], Key: pos[1]})
		return resp.GetRecord(), err
	})
}

// withoutToken returns ctx without the "authorization" metadata that
// connect added, for a clients.Client that sends the token itself.
func withoutToken(ctx context.Context) context.Context {
	md, ok := metadata.FromOutgoingContext(ctx)
	if !ok {
		return ctx
	}
	md = md.Copy()
	delete(md, "authorization")
	return metadata.NewOutgoingContext(ctx, md)
}

// callRecord connects, makes a call that answers one record, and prints it.
func (c *cli) callRecord(ctx context.Context, call func(context.Context, *grpc.ClientConn) (*idempotencyv1.Record, error)) error {
	ctx, conn, done, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer done()
	rec, err := call(ctx, conn)
	if err != nil {
		return c.tls.explain(c.addr, err)
	}
	return c.printRecord(rec)
}

func (c *cli) list(ctx context.Context, args []string) error {
	fs := c.flags("list")
	state := fs.String("state", "", "")
	glob := fs.String("scope", "", "")
	prefix := fs.String("key-prefix", "", "")
	limit := fs.Int("limit", 100, "")
	archived := fs.Bool("archived", false, "")
	uncertain := fs.Bool("uncertain", false, "")
	phase := fs.String("checkpoint-phase", "", "")
	if _, err := parse(fs, args); err != nil {
		return err
	}
	if *uncertain && *archived {
		return usagef("--uncertain lists live records that need a decision; not with --archived")
	}
	req := &idempotencyv1.ListRecordsRequest{ScopeGlob: *glob, KeyPrefix: *prefix, Archived: *archived, Uncertain: *uncertain,
		CheckpointPhase: *phase}
	if *state != "" {
		st, err := parseState(*state)
		if err != nil {
			return err
		}
		req.State = st
	}
	if *uncertain && req.GetState() != idempotencyv1.State_STATE_UNSPECIFIED && req.GetState() != idempotencyv1.State_STATE_UNKNOWN &&
		req.GetState() != idempotencyv1.State_STATE_FAILED_RETRYABLE {
		return usagef("--uncertain with --state %s: only unknown and failed_retryable records need a decision", *state)
	}
	if *limit < 0 {
		return usagef("--limit must be 0 (all) or more, got %d", *limit)
	}
	ctx, conn, done, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer done()
	admin := idempotencyv1.NewAdminClient(conn)
	out := &idempotencyv1.ListRecordsResponse{}
	for {
		req.PageSize = maxPageSize
		if *limit > 0 {
			req.PageSize = int32(min(*limit-len(out.GetRecords()), maxPageSize)) //nolint:gosec // min(..., maxPageSize) bounds it, and the loop runs only while the limit is not reached
		}
		resp, err := admin.ListRecords(ctx, req)
		if err != nil {
			return c.tls.explain(c.addr, err)
		}
		out.Records = append(out.Records, resp.GetRecords()...)
		out.NextPageToken = resp.GetNextPageToken()
		if out.GetNextPageToken() == "" || *limit > 0 && len(out.GetRecords()) >= *limit {
			break
		}
		req.PageToken = out.GetNextPageToken()
	}
	return c.printList(out)
}

func (c *cli) resolve(ctx context.Context, args []string) error {
	fs := c.flags("resolve")
	as := fs.String("as", "", "")
	bodyFile := fs.String("body-file", "", "")
	schemaVersion := fs.String("schema-version", "", "")
	contentType := fs.String("content-type", "", "")
	statusCode := fs.String("status-code", "", "")
	pos, err := parse(fs, args, "SCOPE", "KEY")
	if err != nil {
		return err
	}
	req := &idempotencyv1.ResolveRequest{Scope: pos[0], Key: pos[1]}
	responseSet := *bodyFile != "" || *schemaVersion != "" || *contentType != "" || *statusCode != ""
	switch strings.ToLower(*as) {
	case "completed":
		req.Resolution = idempotencyv1.Resolution_RESOLUTION_COMPLETED
		req.Response = &idempotencyv1.StoredResponse{SchemaVersion: *schemaVersion, ContentType: *contentType}
		if *statusCode != "" {
			n, err := strconv.ParseInt(*statusCode, 10, 32)
			if err != nil {
				return usagef("--status-code must be a 32-bit integer, got %q", *statusCode)
			}
			req.Response.StatusCode = int32(n)
		}
		if *bodyFile != "" {
			if req.Response.Body, err = c.readBody(*bodyFile); err != nil {
				return err
			}
		}
	case "retryable":
		if responseSet {
			return usagef("--as retryable stores no response: drop --body-file, --schema-version, --content-type and --status-code")
		}
		req.Resolution = idempotencyv1.Resolution_RESOLUTION_RETRYABLE
	case "":
		return usagef("resolve needs --as completed or --as retryable")
	default:
		return usagef("--as must be completed or retryable, got %q", *as)
	}
	return c.callRecord(ctx, func(ctx context.Context, conn *grpc.ClientConn) (*idempotencyv1.Record, error) {
		resp, err := idempotencyv1.NewAdminClient(conn).Resolve(ctx, req)
		return resp.GetRecord(), err
	})
}

// readBody reads a response body from a file, or standard input for "-".
func (c *cli) readBody(name string) ([]byte, error) {
	if name == "-" {
		b, err := io.ReadAll(c.stdin)
		if err != nil {
			return nil, fmt.Errorf("read the body from standard input: %w", err)
		}
		return b, nil
	}
	b, err := os.ReadFile(name) //nolint:gosec // the user names this file on the command line
	if err != nil {
		return nil, fmt.Errorf("read the body: %w", err)
	}
	return b, nil
}

func (c *cli) forget(ctx context.Context, args []string) error {
	pos, err := parse(c.flags("forget"), args, "SCOPE", "KEY")
	if err != nil {
		return err
	}
	return c.callRecord(ctx, func(ctx context.Context, conn *grpc.ClientConn) (*idempotencyv1.Record, error) {
		resp, err := idempotencyv1.NewAdminClient(conn).Forget(ctx, &idempotencyv1.ForgetRequest{Scope: pos[0], Key: pos[1]})
		return resp.GetRecord(), err
	})
}

// parseState reads a state as written in the API without its prefix, in any
// case ("unknown", "IN_PROGRESS", "in-progress").
func parseState(s string) (idempotencyv1.State, error) {
	name := "STATE_" + strings.ReplaceAll(strings.ToUpper(s), "-", "_")
	v, ok := idempotencyv1.State_value[name]
	if !ok || v == 0 {
		var names []string
		for i := int32(1); idempotencyv1.State_name[i] != ""; i++ {
			names = append(names, stateName(idempotencyv1.State(i)))
		}
		return 0, usagef("unknown state %q (want one of %s)", s, strings.Join(names, ", "))
	}
	return idempotencyv1.State(v), nil
}

// stateName writes a state as the CLI does: lower case, without prefix.
func stateName(s idempotencyv1.State) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "STATE_"))
}

// describe turns a failed call into one line: the gRPC code as in the
// spec (NOT_FOUND), the message, and the ErrorInfo reason if any.
func describe(err error) string {
	st, ok := status.FromError(err)
	if !ok {
		return err.Error()
	}
	var msg strings.Builder
	msg.WriteString(codeName(st.Code().String()) + ": " + st.Message())
	for _, d := range st.Details() {
		switch d := d.(type) {
		case *errdetails.ErrorInfo:
			msg.WriteString(" (reason " + d.GetReason() + ")")
		case *errdetails.BadRequest:
			for _, v := range d.GetFieldViolations()[min(1, len(d.GetFieldViolations())):] {
				fmt.Fprintf(&msg, "; invalid %s: %s", v.GetField(), v.GetDescription())
			}
		}
	}
	return msg.String()
}

// codeName turns a codes.Code name (FailedPrecondition) into the spec's
// (FAILED_PRECONDITION).
func codeName(camel string) string {
	var b strings.Builder
	for i, r := range camel {
		if i > 0 && r >= 'A' && r <= 'Z' {
			b.WriteByte('_')
		}
		b.WriteRune(r)
	}
	return strings.ToUpper(b.String())
}
