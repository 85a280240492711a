// Command netprobe is a stranger on the local cluster's pod network, for the end-to-end test of
// NetworkPolicy enforcement: GET /dial?addr=host:port tries one TCP connection from this pod and
// answers 200 when it was accepted, 502 with the error when not (refused, or no answer within
// --dial-timeout: a dropped SYN). Every other request (a decode engine sent here by a forged
// remote_bootstrap_addr asks GET /query) is answered 404 and counted: GET /seen answers the
// count. It never ships.
package main

import (
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"sync/atomic"
	"time"
)

func main() {
	listen := flag.String("listen", ":8080", "HTTP address")
	timeout := flag.Duration("dial-timeout", 2*time.Second, "how long a connection may take")
	flag.Parse()
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("GET /dial", func(w http.ResponseWriter, r *http.Request) {
		addr := r.URL.Query().Get("addr")
		if _, _, err := net.SplitHostPort(addr); err != nil {
			http.Error(w, "addr: "+err.Error(), http.StatusBadRequest)
			return
		}
		c, err := net.DialTimeout("tcp", addr, *timeout)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		c.Close()
		fmt.Fprintln(w, "connected")
	})
	var seen atomic.Int64
	mux.HandleFunc("GET /seen", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, seen.Load()) })
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		seen.Add(1)
		http.NotFound(w, r)
	})
	srv := &http.Server{Addr: *listen, Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	if err := srv.ListenAndServe(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
