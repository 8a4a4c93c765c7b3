package server

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"

	"connectrpc.com/connect"
	"connectrpc.com/vanguard"
	"connectrpc.com/vanguard/vanguardgrpc"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// maxHTTPMessageBytes bounds one request or response message of the
// HTTP/JSON API as it travels over HTTP (JSON writes bytes fields in base64,
// so a message near the gRPC limit of 4 MiB needs more room). A larger one
// fails with resource_exhausted before it reaches the service; the gRPC
// limits then apply to what passes.
const maxHTTPMessageBytes = 16 << 20

// connectVersionHeader is the header that marks a Connect unary request.
const connectVersionHeader = "Connect-Protocol-Version"

// apiServices are the services HTTPHandler serves as HTTP/JSON; the others
// on the grpc.Server (health, reflection) stay gRPC only.
var apiServices = []string{
	idempotencyv1.Coordinator_ServiceDesc.ServiceName,
	idempotencyv1.Admin_ServiceDesc.ServiceName,
}

// newAPIHandler serves the Coordinator and Admin methods of g over HTTP with
// the Connect protocol (JSON or binary) and gRPC-Web, translated by
// connectrpc.com/vanguard into gRPC calls that g serves in process. Every
// call therefore goes through g's interceptors: the same authentication
// (bearer token in the Authorization header; a client certificate when the
// listener serves TLS), validation, limits, metrics and logs as over gRPC.
// Errors are Connect's JSON error: {"code": "not_found", "message": …,
// "details": [{"type": "google.rpc.ErrorInfo", "value": …, "debug": {…}}]}.
//
// A POST whose content type is application/json or application/proto is
// taken as a Connect unary call even without the Connect-Protocol-Version
// header, so a plain curl works.
func newAPIHandler(g *grpc.Server) (http.Handler, error) {
	t, err := vanguardgrpc.NewTranscoder(g,
		vanguard.WithCodec(newStrictJSONCodec),
		vanguard.WithDefaultServiceOptions(vanguard.WithMaxMessageBufferBytes(maxHTTPMessageBytes)))
	if err != nil {
		return nil, fmt.Errorf("server: HTTP/JSON transcoder: %w", err)
	}
	return connectByDefault(t), nil
}

// strictJSONCodec is vanguard's JSON codec, except that a request it cannot
// decode (not JSON, a field of the wrong type, an unknown field: a typo such
// as "lease_tokn" must not pass as an absent field) fails invalid_argument,
// a client mistake, instead of vanguard's unknown.
type strictJSONCodec struct{ *vanguard.JSONCodec }

func newStrictJSONCodec(res vanguard.TypeResolver) vanguard.Codec {
	c := vanguard.NewJSONCodec(res)
	c.UnmarshalOptions.DiscardUnknown = false
	return strictJSONCodec{c}
}

// Unmarshal decodes data into msg.
func (c strictJSONCodec) Unmarshal(data []byte, msg proto.Message) error {
	if err := c.JSONCodec.Unmarshal(data, msg); err != nil {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("request is not a valid %s in JSON: %w",
			msg.ProtoReflect().Descriptor().FullName(), err))
	}
	return nil
}

// connectByDefault marks a POST with a unary Connect content type and no
// Connect-Protocol-Version header as a Connect call. Vanguard would
// otherwise take it for a REST call, which these services do not map. It
// also answers an empty JSON body invalid_argument (as connect-go does),
// which vanguard would pass on as no request at all, and a POST of another
// content type (curl's default form encoding, say) 415 with a hint, where
// vanguard would answer a bare 404.
func connectByDefault(next http.Handler) http.Handler {
	errw := connect.NewErrorWriter()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			next.ServeHTTP(w, r)
			return
		}
		mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
		switch {
		case err == nil && (mt == "application/json" || mt == "application/proto"):
		case err == nil && (mt == "application/grpc" || mt == "application/grpc-web" ||
			strings.HasPrefix(mt, "application/grpc+") || strings.HasPrefix(mt, "application/grpc-web+") ||
			strings.HasPrefix(mt, "application/connect+")):
			next.ServeHTTP(w, r)
			return
		default:
			w.Header().Set("Accept-Post", "application/json, application/proto, application/grpc-web+proto, application/grpc-web+json")
			http.Error(w, "unsupported Content-Type: send the request message as JSON with `Content-Type: application/json`",
				http.StatusUnsupportedMediaType)
			return
		}
		if len(r.Header.Values(connectVersionHeader)) == 0 {
			r.Header.Set(connectVersionHeader, "1")
		}
		if mt == "application/json" {
			body := bufio.NewReader(r.Body)
			if _, err := body.Peek(1); err == io.EOF {
				_ = errw.Write(w, r, connect.NewError(connect.CodeInvalidArgument,
					errors.New("empty request body: send a JSON object ({} at least)")))
				return
			}
			r.Body = readCloser{body, r.Body}
		}
		next.ServeHTTP(w, r)
	})
}

// readCloser reads from a buffered reader and closes the body under it.
type readCloser struct {
	io.Reader
	io.Closer
}
