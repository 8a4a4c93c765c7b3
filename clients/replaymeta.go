package clients

import (
	"encoding/base64"
	"encoding/json"
	"sort"
	"strings"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
)

// Prefixes of the StoredResponse.metadata keys under which the interceptor
// stores the headers and trailers a handler set. Each value is a JSON array
// of the key's values; values of "-bin" keys are base64 (standard
// encoding).
const (
	storedHeaderPrefix  = "header:"
	storedTrailerPrefix = "trailer:"
)

// defaultNotReplayed are the metadata keys never stored by default:
// transport and auth metadata, and the interceptor's own.
var defaultNotReplayed = map[string]bool{
	"content-type": true, "content-length": true, "te": true, "user-agent": true, "host": true,
	"date": true, "connection": true, "keep-alive": true, "transfer-encoding": true, "upgrade": true,
	"authorization": true, "proxy-authorization": true, "cookie": true, "set-cookie": true,
	"www-authenticate": true, "proxy-authenticate": true, MetadataKey: true, ResultHeader: true,
}

// replayable reports whether the interceptor stores and replays metadata
// key k.
func (o *interceptorOptions) replayable(k string) bool {
	k = strings.ToLower(k)
	if o.replayKeys != nil {
		return o.replayKeys[k] && k != ResultHeader
	}
	return !defaultNotReplayed[k] && !strings.HasPrefix(k, "grpc-") && !strings.HasPrefix(k, ":")
}

// recordingStream passes a handler's headers and trailers on to the real
// stream and keeps a copy, so they can be stored with its result.
type recordingStream struct {
	grpc.ServerTransportStream
	mu              sync.Mutex
	header, trailer metadata.MD
}

func (s *recordingStream) SetHeader(md metadata.MD) error {
	if err := s.ServerTransportStream.SetHeader(md); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.header = metadata.Join(s.header, md)
	return nil
}

func (s *recordingStream) SendHeader(md metadata.MD) error {
	if err := s.ServerTransportStream.SendHeader(md); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.header = metadata.Join(s.header, md)
	return nil
}

func (s *recordingStream) SetTrailer(md metadata.MD) error {
	if err := s.ServerTransportStream.SetTrailer(md); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.trailer = metadata.Join(s.trailer, md)
	return nil
}

// stored returns the recorded headers and trailers that o lets through, in
// the StoredResponse.metadata form (nil when there are none).
func (s *recordingStream) stored(o *interceptorOptions) map[string]string {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string]string{}
	encode := func(prefix string, md metadata.MD) {
		for k, vs := range md {
			if !o.replayable(k) || len(vs) == 0 {
				continue
			}
			if strings.HasSuffix(k, "-bin") {
				enc := make([]string, len(vs))
				for i, v := range vs {
					enc[i] = base64.StdEncoding.EncodeToString([]byte(v))
				}
				vs = enc
			}
			b, err := json.Marshal(vs)
			if err != nil {
				continue
			}
			out[prefix+strings.ToLower(k)] = string(b)
		}
	}
	encode(storedHeaderPrefix, s.header)
	encode(storedTrailerPrefix, s.trailer)
	if len(out) == 0 {
		return nil
	}
	return out
}

// replayedMetadata decodes stored metadata into headers and trailers.
// Entries it cannot decode are skipped.
func replayedMetadata(stored map[string]string) (header, trailer metadata.MD) {
	header, trailer = metadata.MD{}, metadata.MD{}
	keys := make([]string, 0, len(stored))
	for k := range stored {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		var md metadata.MD
		var name string
		switch {
		case strings.HasPrefix(k, storedHeaderPrefix):
			md, name = header, strings.TrimPrefix(k, storedHeaderPrefix)
		case strings.HasPrefix(k, storedTrailerPrefix):
			md, name = trailer, strings.TrimPrefix(k, storedTrailerPrefix)
		default:
			continue
		}
		var vs []string
		if name == "" || name == ResultHeader || json.Unmarshal([]byte(stored[k]), &vs) != nil {
			continue
		}
		if strings.HasSuffix(name, "-bin") {
			for i, v := range vs {
				b, err := base64.StdEncoding.DecodeString(v)
				if err != nil {
					vs = nil
					break
				}
				vs[i] = string(b)
			}
		}
		md.Append(name, vs...)
	}
	return header, trailer
}
