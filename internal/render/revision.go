// The KV revision: what decides whether decode can read the KV prefill computed.

package render

import (
	"cmp"
	"strings"

	v1alpha1 "pdcluster.dev/pdcluster-operator/api/v1alpha1"
	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// kvFormatFlags are the `vllm serve` flags that change the KV an engine computes or how it
// lays it out: weights (revision, quantization, config overrides), token ids (tokenizer),
// element types. Flags outside this list (logging, limits, scheduling) do not.
// Each maps to its canonical name (vLLM's -q is --quantization).
var kvFormatFlags = map[string]string{
	"--revision": "--revision", "--code-revision": "--code-revision", "--tokenizer": "--tokenizer",
	"--tokenizer-revision": "--tokenizer-revision", "--hf-overrides": "--hf-overrides",
	"--quantization": "--quantization", "-q": "--quantization", "--dtype": "--dtype",
	"--kv-cache-dtype": "--kv-cache-dtype", "--model-impl": "--model-impl",
}

// kvRevisionInputs is everything KVRevision hashes; each field is read by both pools' engines
// alike, so two pods of one revision exchange KV they both understand.
type kvRevisionInputs struct {
	Images     [2]string
	Model      string
	Source     any
	Revision   string
	BlockSize  int32
	Flags      [2]map[string]string
	KVTransfer v1alpha1.KVTransferSpec
	// Parallelism is tensor and pipeline size per pool: they decide the KV's sharding across
	// ranks (data parallelism only multiplies engines).
	Parallelism [2][2]int32
	Gate        string
}

// KVRevision is the PDCluster's KV revision (status.updateRevision, the engine pods'
// serving.pdcluster.dev/kv-revision label): it changes with what decides whether decode can
// read prefill's KV, and only with that, so a change of resources, tolerations or logging
// rolls the pods within one revision.
func KVRevision(pdc *v1alpha1.PDCluster) (string, error) {
	return kvRevision(defaulted(pdc))
}

// kvRevision is KVRevision of a defaulted PDCluster.
func kvRevision(pdc *v1alpha1.PDCluster) (string, error) {
	spec := pdc.Spec
	in := kvRevisionInputs{
		Model:     modelArg(spec.Model),
		Revision:  spec.Model.Revision,
		BlockSize: *spec.Engine.BlockSize,
	}
	switch m := spec.Model; {
	case m.PVC != nil:
		in.Source = *m.PVC
	case m.HostPath != nil:
		in.Source = *m.HostPath
	}
	in.KVTransfer = *spec.KVTransfer.DeepCopy()
	in.KVTransfer.Verification = v1alpha1.KVVerification{} // how the operator judges, not what engines do
	if GateEnabled(spec.KVTransfer) {
		in.Gate = vllm.Hash()
	}
	for i, role := range []v1alpha1.Role{v1alpha1.RolePrefill, v1alpha1.RoleDecode} {
		p := pool(pdc, role)
		in.Images[i] = cmp.Or(p.Image, spec.Engine.Image)
		in.Flags[i] = flagValues(append(append([]string(nil), spec.Engine.Args...), p.Args...), kvFormatFlags)
		in.Parallelism[i] = [2]int32{*p.Parallelism.Tensor, *p.Parallelism.Pipeline}
	}
	h, err := hashOf(in)
	if err != nil {
		return "", err
	}
	return h[:10], nil
}

// flagValues are the values of the flags in names (alias -> canonical name) in a command line,
// as argparse reads it: --flag value or --flag=value, the last one given winning; a flag given
// with no value maps to "".
func flagValues(args []string, names map[string]string) map[string]string {
	out := map[string]string{}
	for i := 0; i < len(args); i++ {
		name, value, hasValue := strings.Cut(args[i], "=")
		canonical, ok := names[name]
		if !ok {
			continue
		}
		if !hasValue && i+1 < len(args) && !strings.HasPrefix(args[i+1], "-") {
			value = args[i+1]
			i++
		}
		out[canonical] = value
	}
	return out
}
