// Command manager runs the PDCluster controller.
package main

import (
	"flag"
	"os"

	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/controllers"
	"pdcluster.dev/pdcluster-operator/internal/render"
)

func main() {
	var metricsAddr, probeAddr string
	var leaderElect, readGate bool
	var concurrency int
	opts := render.DefaultOptions()
	flag.StringVar(&metricsAddr, "metrics-bind-address", ":8080", "address of the Prometheus /metrics endpoint (0 disables it)")
	flag.StringVar(&probeAddr, "health-probe-bind-address", ":8081", "address of /healthz and /readyz")
	flag.BoolVar(&leaderElect, "leader-elect", false, "elect a leader so only one replica reconciles")
	flag.StringVar(&opts.RouterImage, "router-image", opts.RouterImage, "image of the P/D router")
	flag.StringVar(&opts.ConnectorImage, "connector-image", opts.ConnectorImage, "image of the connector sidecar, unless a PDCluster sets spec.connector.image")
	// The operator's own namespace, from the downward API (POD_NAMESPACE) in the chart and
	// config/manager: the PDClusters' NetworkPolicies admit the operator's /gate reads from it.
	if ns := os.Getenv("POD_NAMESPACE"); ns != "" {
		opts.OperatorNamespace = ns
	}
	flag.StringVar(&opts.OperatorNamespace, "operator-namespace", opts.OperatorNamespace, "namespace the operator runs in (default: $POD_NAMESPACE): PDClusters' NetworkPolicies admit the connector sidecars' port from it")
	flag.IntVar(&concurrency, "max-concurrent-reconciles", 16, "PDClusters reconciled at once")
	flag.BoolVar(&readGate, "read-gate-status", true, "read the completion gate's counts from each engine pod's connector sidecar (GET http://<pod IP>:8190/gate) into status.<pool>.gate")
	zapOpts := zap.Options{}
	zapOpts.BindFlags(flag.CommandLine)
	flag.Parse()
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(&zapOpts)))
	setupLog := ctrl.Log.WithName("setup")

	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		setupLog.Error(err, "register client-go types")
		os.Exit(1)
	}
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		setupLog.Error(err, "register PDCluster types")
		os.Exit(1)
	}

	mgr, err := ctrl.NewManager(ctrl.GetConfigOrDie(), ctrl.Options{
		Scheme:                 scheme,
		Cache:                  controllers.CacheOptions(),
		Metrics:                metricsserver.Options{BindAddress: metricsAddr},
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
	if readGate {
		reconciler.GateReader = controllers.NewHTTPGateReader()
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
	setupLog.Info("starting manager")
	if err := mgr.Start(ctrl.SetupSignalHandler()); err != nil {
		setupLog.Error(err, "run manager")
		os.Exit(1)
	}
}
