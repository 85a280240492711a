// Command plainproxy is the reference the router's overhead is measured against (make bench):
// a plain Go reverse proxy (net/http/httputil) spreading requests round robin over --backend
// URLs, with nothing of P/D. It never ships.
//
//	plainproxy --listen 127.0.0.1:9000 --backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002
package main

import (
	"flag"
	"fmt"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"strings"
	"sync/atomic"
)

type backends []*url.URL

func (b *backends) String() string { return fmt.Sprint(*b) }

func (b *backends) Set(s string) error {
	u, err := url.Parse(s)
	if err != nil || u.Host == "" {
		return fmt.Errorf("backend %q is not a URL", s)
	}
	*b = append(*b, u)
	return nil
}

func main() {
	var listen string
	var to backends
	flag.StringVar(&listen, "listen", "127.0.0.1:9000", "address to serve on")
	flag.Var(&to, "backend", "backend URL (repeat for several; round robin)")
	flag.Parse()
	if len(to) == 0 {
		fmt.Fprintln(os.Stderr, "at least one --backend is required")
		os.Exit(2)
	}
	var next atomic.Uint64
	proxy := &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			r.SetURL(to[int(next.Add(1)-1)%len(to)])
		},
		Transport: &http.Transport{MaxIdleConnsPerHost: 256},
	}
	mux := http.NewServeMux()
	mux.Handle("/", proxy)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	if err := http.ListenAndServe(listen, mux); err != nil {
		fmt.Fprintln(os.Stderr, strings.TrimSpace(err.Error()))
		os.Exit(1)
	}
}
