// vLLM's --kv-transfer-config and the transfer engines' environment.

package render

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// KVTransferConfig is the JSON passed to --kv-transfer-config for role.
func KVTransferConfig(kv v1alpha1.KVTransferSpec, role v1alpha1.Role) (string, error) {
	extra := map[string]any{}
	if kv.ExtraConfig != nil && len(kv.ExtraConfig.Raw) > 0 {
		if err := json.Unmarshal(kv.ExtraConfig.Raw, &extra); err != nil {
			return "", fmt.Errorf("kvTransfer.extraConfig must be a JSON object: %w", err)
		}
		for _, k := range sortedKeys(extra) {
			if from, ok := v1alpha1.ReservedExtraConfigKeys[k]; ok { // PDCluster.Validate says so first
				return "", fmt.Errorf("spec.kvTransfer.extraConfig.%s is set by the operator from %s; remove it", k, from)
			}
		}
	}
	connector, protocol := kv.Connector, kv.Protocol
	if connector == v1alpha1.ConnectorMooncake {
		extra["mooncake_protocol"] = string(protocol)
		if protocol == v1alpha1.ProtocolRDMA {
			extra["device_name"] = strings.Join(kv.RDMADevices, ",")
		}
	}
	cfg := map[string]any{
		"kv_connector":           string(connector),
		"kv_role":                string(KVRole(role)),
		"kv_buffer_device":       string(kv.BufferDevice),
		"kv_load_failure_policy": string(kv.LoadFailurePolicy),
	}
	if len(extra) > 0 {
		cfg["kv_connector_extra_config"] = extra
	}
	if GateEnabled(kv) {
		class, module := gatedConnector(connector)
		cfg["kv_connector"], cfg["kv_connector_module_path"] = class, module
	}
	// encoding/json sorts map keys, so the flag (and the config hash) is stable.
	b, err := json.Marshal(cfg)
	if err != nil {
		return "", fmt.Errorf("encode kv-transfer-config: %w", err)
	}
	return string(b), nil
}

// connectorEnv is the environment vLLM's KV connector reads in role's engine.
func connectorEnv(kv v1alpha1.KVTransferSpec, role v1alpha1.Role) []corev1.EnvVar {
	rdma := kv.Protocol == v1alpha1.ProtocolRDMA
	switch kv.Connector {
	case v1alpha1.ConnectorNixl:
		env := []corev1.EnvVar{
			// vLLM hands this host to the other side in kv_transfer_params; its default,
			// localhost, makes every handshake from another pod fail.
			{Name: vllm.EnvNixlSideChannelHost, Value: "$(POD_IP)"},
			{Name: vllm.EnvNixlSideChannelPort, Value: strconv.Itoa(int(vllm.NixlSideChannelPort))},
		}
		if rdma {
			env = append(env, corev1.EnvVar{Name: "UCX_NET_DEVICES", Value: ucxNetDevices(kv.RDMADevices)})
		}
		return env
	default:
		if role != v1alpha1.RolePrefill {
			return nil // only a kv_producer starts the bootstrap server
		}
		return []corev1.EnvVar{{Name: vllm.EnvMooncakeBootstrapPort, Value: strconv.Itoa(int(vllm.MooncakeBootstrapPort))}}
	}
}

// ucxNetDevices is UCX's device list for NIXL: UCX names an RDMA device with its port
// (mlx5_0:1); a device given without one gets port 1.
func ucxNetDevices(devices []string) string {
	out := make([]string, len(devices))
	for i, d := range devices {
		if !strings.Contains(d, ":") {
			d += ":1"
		}
		out[i] = d
	}
	return strings.Join(out, ",")
}

// KVRole is vLLM's kv_role of the role's engines; the router has none.
func KVRole(r v1alpha1.Role) vllm.KVRole {
	switch r {
	case v1alpha1.RolePrefill:
		return vllm.KVProducer
	case v1alpha1.RoleDecode:
		return vllm.KVConsumer
	}
	return ""
}
