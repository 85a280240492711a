// Command router is the P/D proxy (see internal/router).
package main

import (
	"context"
	"errors"
	"flag"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"pdcluster.dev/pdcluster-operator/internal/router"
)

type list []string

func (l *list) String() string     { return strings.Join(*l, ",") }
func (l *list) Set(v string) error { *l = append(*l, v); return nil }

func main() {
	var listen, mode string
	var prefill, decode list
	flag.StringVar(&listen, "listen", "127.0.0.1:8080", "HTTP address of the proxy")
	flag.StringVar(&mode, "mode", "mooncake", "mooncake (concurrent legs) or nixl (sequential)")
	flag.Var(&prefill, "prefill", "prefill engine as URL or URL,BOOTSTRAP_URL (repeatable)")
	flag.Var(&decode, "decode", "decode engine URL (repeatable)")
	zo := zap.Options{}
	zo.BindFlags(flag.CommandLine)
	flag.Parse()
	log := zap.New(zap.UseFlagOptions(&zo))
	cfg := router.Config{Mode: router.Mode(mode), Decode: decode}
	for _, p := range prefill {
		url, boot, _ := strings.Cut(p, ",")
		cfg.Prefill = append(cfg.Prefill, router.Prefill{URL: url, Bootstrap: boot})
	}
	reg := prometheus.NewRegistry()
	r, err := router.New(cfg, log, reg)
	if err != nil {
		log.Error(err, "configure router")
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	srv := &http.Server{Addr: listen, Handler: r.Handler(reg), ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		c, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(c)
	}()
	log.Info("router serving", "listen", listen, "mode", mode, "prefill", prefill.String(), "decode", decode.String())
	if err := srv.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
		log.Error(err, "serve")
		os.Exit(1)
	}
}
