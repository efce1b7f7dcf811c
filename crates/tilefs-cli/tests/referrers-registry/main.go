// referrers-registry: an OCI registry that has the referrers API
// (GET /v2/NAME/referrers/DIGEST, OCI distribution spec 1.1), for the
// tests of `tilefs index` (Debian's docker-registry 2.8 lacks the API, as
// distribution v3 does). It is go-containerregistry's registry
// (pkg/registry, in memory) with its referrers support on, and an access
// log: one line per request, "METHOD PATH STATUS BYTES", appended to the
// file -log names. go-containerregistry's registry answers a finished
// blob upload and a manifest PUT with 201 but without the Location header
// the distribution spec requires (and tilefs's client needs): the wrapper
// adds it.
//
//	referrers-registry -addr 127.0.0.1:PORT -log FILE
package main

import (
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"strings"
	"sync"

	"github.com/google/go-containerregistry/pkg/registry"
)

type recorder struct {
	http.ResponseWriter
	req    *http.Request
	status int
	bytes  int64
}

// location is where a PUT that answers 201 put what it created.
func location(req *http.Request) string {
	p := req.URL.Path
	if i := strings.Index(p, "/blobs/uploads/"); i >= 0 {
		return p[:i] + "/blobs/" + req.URL.Query().Get("digest")
	}
	return p
}

func (r *recorder) WriteHeader(code int) {
	r.status = code
	if code == http.StatusCreated && r.req.Method == http.MethodPut && r.Header().Get("Location") == "" {
		r.Header().Set("Location", location(r.req))
	}
	r.ResponseWriter.WriteHeader(code)
}

func (r *recorder) Write(b []byte) (int, error) {
	if r.status == 0 {
		r.status = http.StatusOK
	}
	n, err := r.ResponseWriter.Write(b)
	r.bytes += int64(n)
	return n, err
}

func main() {
	addr := flag.String("addr", "127.0.0.1:0", "address to listen on")
	logPath := flag.String("log", "", "access log file")
	flag.Parse()
	if *logPath == "" {
		fmt.Fprintln(os.Stderr, "referrers-registry: -log FILE is needed")
		os.Exit(2)
	}
	f, err := os.OpenFile(*logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		fmt.Fprintln(os.Stderr, "referrers-registry:", err)
		os.Exit(1)
	}
	var mu sync.Mutex
	reg := registry.New(registry.WithReferrersSupport(true), registry.Logger(log.New(io.Discard, "", 0)))
	handler := http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		rec := &recorder{ResponseWriter: w, req: req}
		reg.ServeHTTP(rec, req)
		if rec.status == 0 {
			rec.status = http.StatusOK
		}
		mu.Lock()
		fmt.Fprintf(f, "%s %s %d %d\n", req.Method, req.URL.RequestURI(), rec.status, rec.bytes)
		mu.Unlock()
	})
	if err := http.ListenAndServe(*addr, handler); err != nil {
		fmt.Fprintln(os.Stderr, "referrers-registry:", err)
		os.Exit(1)
	}
}
