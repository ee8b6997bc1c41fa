package cmd

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net/http"
	"os"
	"time"
)

// Limits of one request on both servers (the 1 MiB body limit lives in the
// handlers, httpapi.MaxBodyBytes and the agent's bodyLimit).
const (
	// maxHeaderBytes bounds the request line and headers: a bearer token,
	// an Idempotency-Key and a few standard headers fit in far less. Larger
	// requests get 431 from net/http.
	maxHeaderBytes = 64 << 10
	// readTimeout bounds reading a whole request, headers and a 1 MiB body,
	// so a client that trickles bytes cannot hold a connection open.
	readTimeout = time.Minute
	// controlWriteTimeout bounds one control API request from the end of
	// its headers to the end of its answer. A create waits for its agent
	// (up to three 60 s attempts under TCG, plus backoff) and a fork spawns
	// several children: 10 minutes is far above both and still ends a
	// request that is stuck. The agent has no write timeout: it streams
	// snapshot files of many GiB to other agents, which bound the pull on
	// their side, and each of its operations has its own timeout.
	controlWriteTimeout = 10 * time.Minute
)

// httpClientTrusting returns an HTTP client that trusts the PEM
// certificates in caFile besides the system's, for calls to agents whose
// certificates a private CA signed; nil when caFile is empty.
func httpClientTrusting(caFile, what string) (*http.Client, error) {
	if caFile == "" {
		return nil, nil
	}
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("read %s CA file: %w", what, err)
	}
	pool, err := x509.SystemCertPool()
	if err != nil {
		pool = x509.NewCertPool()
	}
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s CA file %s holds no PEM certificate", what, caFile)
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	return &http.Client{Transport: tr}, nil
}
