package controllers

import (
	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// Operator metrics, served with controller-runtime's own on the manager's /metrics endpoint.
var (
	appliesTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pdcluster_child_applies_total",
		Help: "Server-side applies of PDCluster children, by kind and action (create, update) and result (ok, error).",
	}, []string{"kind", "action", "result"})
	readyGauge = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pdcluster_ready",
		Help: "1 when the PDCluster's Ready condition is True, else 0.",
	}, []string{"namespace", "name"})
	poolReadyReplicas = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pdcluster_pool_ready_replicas",
		Help: "Ready replicas of each PDCluster pool (prefill, decode, router).",
	}, []string{"namespace", "name", "pool"})
	connectorRestarts = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pdcluster_connector_restarts_total",
		Help: "Pods the operator restarted because their connector sidecar stayed unready, by pool.",
	}, []string{"namespace", "name", "pool"})
	connectorUnhealthy = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pdcluster_connector_unhealthy_pods",
		Help: "Running engine pods whose connector sidecar is not ready.",
	}, []string{"namespace", "name"})
	kvVerified = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pdcluster_kv_transfer_verified",
		Help: "KVTransferVerified: 1 True (decode receives its prompts' KV from prefill), 0 False, -1 Unknown (no traffic, no counts); absent with verification Disabled. reason is the condition's.",
	}, []string{"namespace", "name", "reason"})
	kvExternalShare = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pdcluster_kv_external_share_percent",
		Help: "Percent of the decode engines' prompt tokens received from prefill over the verification window (status.kvTransfer.externalSharePercent); absent without traffic.",
	}, []string{"namespace", "name"})
	kvTransferMBps = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pdcluster_kv_transfer_mbps",
		Help: "The KV transfer rate the engines measured over the verification window, MB/s (status.kvTransfer.transferMBps); absent when no transfer was timed.",
	}, []string{"namespace", "name"})
	poolDesiredReplicas = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pdcluster_pool_desired_replicas",
		Help: "Desired replicas of each PDCluster pool (prefill, decode, router).",
	}, []string{"namespace", "name", "pool"})
	rolloutInProgress = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pdcluster_rollout_in_progress",
		Help: "1 while engine pods of an older KV revision run beside the update revision's (Progressing True, KVRevisionRollingOut), else 0.",
	}, []string{"namespace", "name"})
	revisionTraffic = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pdcluster_revision_traffic_percent",
		Help: "Share of new requests the routers send to each running KV revision (status.revisions[].trafficPercent).",
	}, []string{"namespace", "name", "revision"})
)

func init() {
	metrics.Registry.MustRegister(appliesTotal, readyGauge, poolReadyReplicas, poolDesiredReplicas, connectorRestarts, connectorUnhealthy, kvVerified, kvExternalShare, kvTransferMBps,
		rolloutInProgress, revisionTraffic, podReads)
}

// recordStatus exports one PDCluster's readiness, replica counts and unhealthy connectors.
func recordStatus(pdc *v1alpha1.PDCluster) {
	ready := 0.0
	for _, c := range pdc.Status.Conditions {
		if c.Type == v1alpha1.ConditionReady && c.Status == "True" {
			ready = 1
		}
	}
	readyGauge.WithLabelValues(pdc.Namespace, pdc.Name).Set(ready)
	connectorUnhealthy.WithLabelValues(pdc.Namespace, pdc.Name).Set(float64(len(pdc.Status.Connector.UnhealthyPods)))
	kvVerified.DeletePartialMatch(prometheus.Labels{"namespace": pdc.Namespace, "name": pdc.Name})
	if c := meta.FindStatusCondition(pdc.Status.Conditions, v1alpha1.ConditionKVTransferVerified); c != nil {
		v := -1.0 // Unknown
		switch c.Status {
		case metav1.ConditionTrue:
			v = 1
		case metav1.ConditionFalse:
			v = 0
		}
		kvVerified.WithLabelValues(pdc.Namespace, pdc.Name, c.Reason).Set(v)
	}
	if kv := pdc.Status.KVTransfer; kv != nil && kv.ExternalSharePercent != nil {
		kvExternalShare.WithLabelValues(pdc.Namespace, pdc.Name).Set(float64(*kv.ExternalSharePercent))
	} else {
		kvExternalShare.DeleteLabelValues(pdc.Namespace, pdc.Name)
	}
	if kv := pdc.Status.KVTransfer; kv != nil && kv.TransferMBps != nil {
		kvTransferMBps.WithLabelValues(pdc.Namespace, pdc.Name).Set(float64(*kv.TransferMBps))
	} else {
		kvTransferMBps.DeleteLabelValues(pdc.Namespace, pdc.Name)
	}
	rolling := 0.0
	if c := meta.FindStatusCondition(pdc.Status.Conditions, v1alpha1.ConditionProgressing); c != nil && c.Status == metav1.ConditionTrue && c.Reason == v1alpha1.ReasonKVRevisionRollingOut {
		rolling = 1
	}
	rolloutInProgress.WithLabelValues(pdc.Namespace, pdc.Name).Set(rolling)
	revisionTraffic.DeletePartialMatch(prometheus.Labels{"namespace": pdc.Namespace, "name": pdc.Name})
	for _, rev := range pdc.Status.Revisions {
		revisionTraffic.WithLabelValues(pdc.Namespace, pdc.Name, rev.Revision).Set(float64(rev.TrafficPercent))
	}
	for pool, ps := range map[string]v1alpha1.PoolStatus{"prefill": pdc.Status.Prefill, "decode": pdc.Status.Decode, "router": pdc.Status.Router} {
		poolReadyReplicas.WithLabelValues(pdc.Namespace, pdc.Name, pool).Set(float64(ps.ReadyReplicas))
		poolDesiredReplicas.WithLabelValues(pdc.Namespace, pdc.Name, pool).Set(float64(ps.Replicas))
	}
}

// forgetStatus drops a deleted PDCluster's series so they do not linger as stale values.
func forgetStatus(namespace, name string) {
	readyGauge.DeleteLabelValues(namespace, name)
	poolReadyReplicas.DeletePartialMatch(prometheus.Labels{"namespace": namespace, "name": name})
	poolDesiredReplicas.DeletePartialMatch(prometheus.Labels{"namespace": namespace, "name": name})
	connectorRestarts.DeletePartialMatch(prometheus.Labels{"namespace": namespace, "name": name})
	connectorUnhealthy.DeleteLabelValues(namespace, name)
	kvVerified.DeletePartialMatch(prometheus.Labels{"namespace": namespace, "name": name})
	kvExternalShare.DeleteLabelValues(namespace, name)
	kvTransferMBps.DeleteLabelValues(namespace, name)
	rolloutInProgress.DeleteLabelValues(namespace, name)
	revisionTraffic.DeletePartialMatch(prometheus.Labels{"namespace": namespace, "name": name})
}
