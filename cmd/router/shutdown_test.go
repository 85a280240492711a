package main

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"testing"
	"time"
)

// A SIGTERM lets the requests in flight end (a generation streams for seconds) before the
// router exits, and refuses new connections meanwhile.
func TestShutdownWaitsForRequestsInFlight(t *testing.T) {
	started, release := make(chan struct{}), make(chan struct{})
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		close(started)
		<-release
		_, _ = io.WriteString(w, "done")
	})}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	ctx, cancel := context.WithCancel(context.Background())
	done := shutdownOnDone(ctx, srv, time.Minute)

	answer := make(chan string, 1)
	go func() {
		resp, err := http.Get("http://" + ln.Addr().String())
		if err != nil {
			answer <- err.Error()
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		answer <- string(b)
	}()
	<-started
	cancel() // SIGTERM
	if err := <-served; !errors.Is(err, http.ErrServerClosed) {
		t.Fatalf("serve: %v", err)
	}
	select {
	case <-done:
		t.Fatal("shutdown ended with a request in flight")
	case <-time.After(100 * time.Millisecond):
	}
	if _, err := net.Dial("tcp", ln.Addr().String()); err == nil {
		t.Error("a new connection was accepted after SIGTERM")
	}
	close(release)
	if got := <-answer; got != "done" {
		t.Errorf("request in flight answered %q, want done", got)
	}
	<-done
}
