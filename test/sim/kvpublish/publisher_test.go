package kvpublish

import "testing"

// Ranks publish where vLLM's offset_endpoint_port puts them: the tcp port plus the rank, port 0
// left to the system, rank 0 and other endpoints as given.
func TestOffsetEndpoint(t *testing.T) {
	for _, tc := range []struct {
		endpoint string
		rank     int
		want     string
	}{
		{"tcp://*:5557", 0, "tcp://*:5557"},
		{"tcp://*:5557", 3, "tcp://*:5560"},
		{"tcp://10.0.0.1:5757", 1, "tcp://10.0.0.1:5758"},
		{"tcp://*:0", 2, "tcp://*:0"},
		{"", 2, ""},
		{"inproc://cache", 0, "inproc://cache"},
	} {
		if got := OffsetEndpoint(tc.endpoint, tc.rank); got != tc.want {
			t.Errorf("OffsetEndpoint(%q, %d) = %q, want %q", tc.endpoint, tc.rank, got, tc.want)
		}
	}
}
