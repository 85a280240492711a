// The rendered containers' security contexts.

package render

import (
	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
)

// nonRootUser runs the operator's own images (static binaries on an empty base), which need no
// user of their own in the image.
const nonRootUser = 65532

// hardened is every rendered container's security context: no privilege escalation, every
// capability dropped but add, the runtime's default seccomp profile (what the restricted Pod
// Security Standard asks of a container, bar the user).
func hardened(add ...corev1.Capability) *corev1.SecurityContext {
	return &corev1.SecurityContext{
		AllowPrivilegeEscalation: ptr.To(false),
		Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}, Add: add},
		SeccompProfile:           &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
	}
}

// engineCapabilities: RDMA needs to pin (mlock) the registered KV-cache memory; TCP needs
// nothing, so a TCP PDCluster runs in a namespace that enforces the baseline Pod Security
// Standard (which refuses IPC_LOCK).
func engineCapabilities(kv v1alpha1.KVTransferSpec) []corev1.Capability {
	if kv.Protocol == v1alpha1.ProtocolRDMA {
		return []corev1.Capability{"IPC_LOCK"}
	}
	return nil
}

// readOnlyRoot gives the container a read-only root filesystem.
func readOnlyRoot(sc *corev1.SecurityContext) *corev1.SecurityContext {
	sc.ReadOnlyRootFilesystem = ptr.To(true)
	return sc
}

// nonRoot runs the container as nonRootUser, whatever user its image names.
func nonRoot(sc *corev1.SecurityContext) *corev1.SecurityContext {
	sc.RunAsNonRoot, sc.RunAsUser = ptr.To(true), ptr.To(int64(nonRootUser))
	return sc
}
