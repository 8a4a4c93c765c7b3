package main

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// tlsSettings are idemctl's transport settings.
type tlsSettings struct {
	ca, cert, key, serverName string
	on                        bool // --tls: TLS with the system roots
	insecure                  bool // --insecure: plaintext to a non-loopback address
	plaintext                 bool // set by credentials: the connection is plaintext
}

// tlsFromEnv reads the defaults from the environment.
func tlsFromEnv(getenv func(string) string) tlsSettings {
	b := func(name string) bool {
		v, err := strconv.ParseBool(getenv(name))
		return err == nil && v
	}
	return tlsSettings{ca: getenv("IDEMCOORD_TLS_CA"), cert: getenv("IDEMCOORD_TLS_CERT"), key: getenv("IDEMCOORD_TLS_KEY"),
		serverName: getenv("IDEMCOORD_TLS_SERVER_NAME"), on: b("IDEMCOORD_TLS"), insecure: b("IDEMCOORD_INSECURE")}
}

// bind adds the TLS flags to fs.
func (s *tlsSettings) bind(fs *flag.FlagSet) {
	fs.StringVar(&s.ca, "tls-ca", s.ca, "")
	fs.StringVar(&s.cert, "tls-cert", s.cert, "")
	fs.StringVar(&s.key, "tls-key", s.key, "")
	fs.StringVar(&s.serverName, "tls-server-name", s.serverName, "")
	fs.BoolVar(&s.on, "tls", s.on, "")
	fs.BoolVar(&s.insecure, "insecure", s.insecure, "")
}

// enabled reports whether the settings ask for TLS.
func (s *tlsSettings) enabled() bool {
	return s.on || s.ca != "" || s.cert != "" || s.key != "" || s.serverName != ""
}

// credentials returns the transport credentials for addr: TLS when asked
// for, plaintext only to a loopback address or with --insecure.
func (s *tlsSettings) credentials(addr string) (credentials.TransportCredentials, error) {
	if !s.enabled() {
		if !s.insecure && !loopback(addr) {
			return nil, usagef("refusing plaintext to %s, which is not a loopback address: the token and the records "+
				"would travel in clear; use TLS (--tls-ca FILE, or --tls for the system roots) or pass --insecure", addr)
		}
		s.plaintext = true
		return insecure.NewCredentials(), nil
	}
	if (s.cert == "") != (s.key == "") {
		return nil, usagef("--tls-cert and --tls-key go together")
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: s.serverName}
	if s.ca != "" {
		pem, err := os.ReadFile(s.ca)
		if err != nil {
			return nil, fmt.Errorf("--tls-ca: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--tls-ca %s: no PEM certificate in it", s.ca)
		}
		cfg.RootCAs = pool
	}
	if s.cert != "" {
		pair, err := tls.LoadX509KeyPair(s.cert, s.key)
		if err != nil {
			return nil, fmt.Errorf("--tls-cert/--tls-key: %w", err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return credentials.NewTLS(cfg), nil
}

// explain turns a transport failure that comes from a TLS mismatch into a
// clear error; any other error is returned as it is.
func (s *tlsSettings) explain(addr string, err error) error {
	if status.Code(err) != codes.Unavailable {
		return err
	}
	msg := status.Convert(err).Message()
	switch {
	case !s.plaintext && strings.Contains(msg, "first record does not look like a TLS handshake"):
		return fmt.Errorf("the coordinator at %s does not speak TLS, but TLS was asked for (--tls-ca, --tls-cert, --tls-server-name or --tls): %w", addr, err)
	case s.plaintext && speaksTLS(addr):
		return fmt.Errorf("the coordinator at %s speaks TLS; idemctl sent plaintext: pass --tls-ca FILE (or --tls for the system roots): %w", addr, err)
	}
	return err
}

// speaksTLS reports whether a TLS handshake with addr gets as far as a
// server certificate (its validity does not matter here).
func speaksTLS(addr string) bool {
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return false
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	var sawCert bool
	c := tls.Client(conn, &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS12, //nolint:gosec // a probe only, nothing is sent
		VerifyConnection: func(cs tls.ConnectionState) error {
			sawCert = len(cs.PeerCertificates) > 0
			return errors.New("probe only")
		}})
	_ = c.Handshake()
	return sawCert
}

// loopback reports whether addr's host is a loopback address or localhost.
func loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		host = addr
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
