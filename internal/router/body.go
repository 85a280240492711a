// The legs' request bodies: the client's JSON with the router's kv_transfer_params, encoded
// without re-encoding the client's values.

package router

import (
	"encoding/json"
	"maps"
	"slices"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// rawJSON encodes v, which cannot fail for the maps of strings, numbers and bools given here.
func rawJSON(v any) json.RawMessage {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}

// withParams is body with kv_transfer_params set.
func withParams(body map[string]json.RawMessage, params map[string]any) map[string]json.RawMessage {
	b := maps.Clone(body)
	b[vllm.KVTransferParams] = rawJSON(params)
	return b
}

var (
	jsonOne   = json.RawMessage("1")
	jsonFalse = json.RawMessage("false")
)

// prefillBody is the prefill leg: one token, no streaming, the given transfer params.
func prefillBody(body map[string]json.RawMessage, params map[string]any) map[string]json.RawMessage {
	pb := withParams(body, params)
	pb["max_tokens"] = jsonOne
	if _, ok := pb["max_completion_tokens"]; ok {
		pb["max_completion_tokens"] = jsonOne
	}
	pb["stream"] = jsonFalse
	delete(pb, "stream_options")
	return pb
}

// appendJSONString appends s as a JSON string: plain ASCII as it is, anything else through
// encoding/json.
func appendJSONString(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c > 0x7e || c == '"' || c == '\\' {
			q, _ := json.Marshal(s)
			return append(b, q...)
		}
	}
	b = append(b, '"')
	b = append(b, s...)
	return append(b, '"')
}

// encodeBody writes body as a JSON object, keys sorted as json.Marshal would. The values are
// copied as they are: they came from json.Unmarshal or rawJSON, so they are valid JSON, and
// json.Marshal would only scan them again.
func encodeBody(body map[string]json.RawMessage) []byte {
	keys := slices.Sorted(maps.Keys(body))
	n := 2
	for _, k := range keys {
		n += len(k) + len(body[k]) + 4
	}
	b := make([]byte, 0, n+16)
	b = append(b, '{')
	for i, k := range keys {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendJSONString(b, k)
		b = append(b, ':')
		b = append(b, body[k]...)
	}
	return append(b, '}')
}
