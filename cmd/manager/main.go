// Command manager runs the PDCluster controller.
package main

import (
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/validation"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	"sigs.k8s.io/controller-runtime/pkg/metrics/filters"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	lwsv1 "sigs.k8s.io/lws/api/leaderworkerset/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/controllers"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

// settings are the manager's command line and environment.
type settings struct {
	metricsAddr, probeAddr string
	metricsSecure          bool
	leaderElect, readPods  bool
	concurrency            int
	// deprecated are the deprecated flags given, each with what replaces it, logged at start.
	deprecated      []string
	watchNamespaces []string
	opts            render.Options
	zap             zap.Options
}

// parseFlags is separate from main so a test can check what the chart and config/manager give
// the binary (POD_NAMESPACE from the downward API) reaches the render options.
func parseFlags(args []string, getenv func(string) string) (settings, error) {
	s := settings{opts: render.DefaultOptions()}
	fs := flag.NewFlagSet("manager", flag.ContinueOnError)
	fs.StringVar(&s.metricsAddr, "metrics-bind-address", ":8080", "address of the Prometheus /metrics endpoint (0 disables it)")
	fs.BoolVar(&s.metricsSecure, "metrics-secure", true, "serve /metrics over HTTPS (a self-signed certificate) to clients the API server authenticates and authorizes for GET /metrics (TokenReview, SubjectAccessReview); false: plain HTTP to anyone who reaches it")
	fs.StringVar(&s.probeAddr, "health-probe-bind-address", ":8081", "address of /healthz and /readyz")
	fs.BoolVar(&s.leaderElect, "leader-elect", false, "elect a leader so only one replica reconciles")
	fs.StringVar(&s.opts.RouterImage, "router-image", s.opts.RouterImage, "image of the P/D router")
	fs.StringVar(&s.opts.ConnectorImage, "connector-image", s.opts.ConnectorImage, "image of the connector sidecar, unless a PDCluster sets spec.connector.image")
	// The operator's own namespace, from the downward API (POD_NAMESPACE) in the chart and
	// config/manager: the PDClusters' NetworkPolicies admit the operator's /gate reads from it.
	if ns := getenv("POD_NAMESPACE"); ns != "" {
		s.opts.OperatorNamespace = ns
	}
	fs.StringVar(&s.opts.OperatorNamespace, "operator-namespace", s.opts.OperatorNamespace, "namespace the operator runs in (default: $POD_NAMESPACE): PDClusters' NetworkPolicies admit the connector sidecars' port from its manager pods")
	fs.Func("watch-namespaces", "comma-separated namespaces whose PDClusters the operator reconciles (default: every namespace); with it the operator needs Roles in those namespaces only (the chart's watchNamespaces)", func(v string) error {
		s.watchNamespaces = nil
		for ns := range strings.SplitSeq(v, ",") {
			if ns = strings.TrimSpace(ns); ns != "" {
				if errs := validation.IsDNS1123Label(ns); len(errs) > 0 {
					return fmt.Errorf("namespace %q: %s", ns, strings.Join(errs, "; "))
				}
				s.watchNamespaces = append(s.watchNamespaces, ns)
			}
		}
		return nil
	})
	fs.IntVar(&s.concurrency, "max-concurrent-reconciles", 16, "PDClusters reconciled at once")
	fs.BoolVar(&s.readPods, "read-pod-reports", true, "read what the pods report into status: each engine pod's connector sidecar (GET http://<pod IP>:8190/gate: the gate's counts, KV-verification evidence, held sends for drain deletion costs) and each router (GET /canary, GET /pairs, GET /routing); false leaves them all out (a cluster whose pods run no sidecar, as kwok's)")
	fs.BoolFunc("read-gate-status", "deprecated: use --read-pod-reports, which it sets (it always covered the routers' canaries, pair counts and routing counts too)", func(v string) error {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return err
		}
		s.readPods = b
		s.deprecated = append(s.deprecated, "--read-gate-status: use --read-pod-reports")
		return nil
	})
	s.zap.BindFlags(fs)
	return s, fs.Parse(args)
}

func main() {
	s, err := parseFlags(os.Args[1:], os.Getenv)
	if err != nil {
		os.Exit(2) // the FlagSet printed why
	}
	metricsAddr, probeAddr, leaderElect, readPods, concurrency, opts, zapOpts := s.metricsAddr, s.probeAddr, s.leaderElect, s.readPods, s.concurrency, s.opts, s.zap
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(&zapOpts)))
	setupLog := ctrl.Log.WithName("setup")
	for _, d := range s.deprecated {
		setupLog.Info("deprecated flag", "flag", d)
	}

	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		setupLog.Error(err, "register client-go types")
		os.Exit(1)
	}
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		setupLog.Error(err, "register PDCluster types")
		os.Exit(1)
	}
	if err := lwsv1.AddToScheme(scheme); err != nil {
		setupLog.Error(err, "register LeaderWorkerSet types")
		os.Exit(1)
	}

	mgr, err := ctrl.NewManager(ctrl.GetConfigOrDie(), ctrl.Options{
		Scheme:                 scheme,
		Cache:                  controllers.CacheOptions(s.watchNamespaces...),
		Metrics:                metricsOptions(metricsAddr, s.metricsSecure),
		HealthProbeBindAddress: probeAddr,
		LeaderElection:         leaderElect,
		LeaderElectionID:       "pdcluster-operator.serving.pdcluster.dev",
	})
	if err != nil {
		setupLog.Error(err, "create manager")
		os.Exit(1)
	}
	reconciler := &controllers.PDClusterReconciler{
		Client:    mgr.GetClient(),
		APIReader: mgr.GetAPIReader(),
		Scheme:    mgr.GetScheme(),
		Recorder:  mgr.GetEventRecorder(v1alpha1.OperatorName),
		Options:   opts,

		MaxConcurrentReconciles: concurrency,
	}
	if readPods {
		// Read outside Reconcile: a slow pod never holds a reconcile worker.
		routers := controllers.NewHTTPRouterReader()
		reports := controllers.NewPodReports(controllers.NewHTTPGateReader(), routers, routers, routers)
		reconciler.Reports = reports
		reconciler.GateReader, reconciler.CanaryReader, reconciler.PairsReader, reconciler.RoutingReader = reports, reports, reports, reports
	}
	if err := reconciler.SetupWithManager(mgr); err != nil {
		setupLog.Error(err, "set up controller")
		os.Exit(1)
	}
	if err := mgr.AddHealthzCheck("healthz", healthz.Ping); err != nil {
		setupLog.Error(err, "add health check")
		os.Exit(1)
	}
	if err := mgr.AddReadyzCheck("readyz", healthz.Ping); err != nil {
		setupLog.Error(err, "add ready check")
		os.Exit(1)
	}
	setupLog.Info("starting manager", "watchNamespaces", s.watchNamespaces)
	if err := mgr.Start(ctrl.SetupSignalHandler()); err != nil {
		setupLog.Error(err, "run manager")
		os.Exit(1)
	}
}

// metricsOptions serves /metrics on addr; secure puts it behind HTTPS and the API server's
// authentication and authorization (a scraper needs a token allowed GET on /metrics, e.g.
// bound to the chart's metrics-reader ClusterRole).
func metricsOptions(addr string, secure bool) metricsserver.Options {
	o := metricsserver.Options{BindAddress: addr}
	if secure {
		o.SecureServing, o.FilterProvider = true, filters.WithAuthenticationAndAuthorization
	}
	return o
}
