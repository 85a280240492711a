package enginesim

import (
	"fmt"
	"net/http"
	"strconv"

	"pdcluster.dev/pdcluster-operator/connector/vllm"
)

// DataParallel serves the API of a `vllm serve` that runs engines, one per data-parallel rank
// (engines[i] is rank i), as vLLM's API server fronts its EngineCores: a completion naming a
// rank in X-data-parallel-rank goes to that engine (a rank out of range is refused with 400,
// as vLLM's input processor refuses it; a header that is not a number is ignored, as vLLM
// ignores it), any other to the engine with the fewest requests, as vLLM's balancer does;
// /health fails when any engine died.
func DataParallel(engines []*Engine) http.Handler {
	if len(engines) == 1 {
		return engines[0].Handler()
	}
	handlers := make([]http.Handler, len(engines))
	for i, e := range engines {
		handlers[i] = e.Handler()
	}
	mux := http.NewServeMux()
	completion := func(w http.ResponseWriter, r *http.Request) {
		rank, ok := -1, false
		if v := r.Header.Get(vllm.DataParallelRankHeader); v != "" {
			if n, err := strconv.Atoi(v); err == nil {
				if n < 0 || n >= len(engines) {
					writeError(w, http.StatusBadRequest, fmt.Sprintf("data_parallel_rank %d is out of range [0, %d).", n, len(engines)), "BadRequestError")
					return
				}
				rank, ok = n, true
			}
		}
		if !ok {
			rank = 0
			for i, e := range engines {
				if e.sched.Stats().Requests < engines[rank].sched.Stats().Requests {
					rank = i
				}
			}
		}
		handlers[rank].ServeHTTP(w, r)
	}
	mux.HandleFunc("POST /v1/completions", completion)
	mux.HandleFunc("POST /v1/chat/completions", completion)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		for _, e := range engines {
			if e.Dead() != nil {
				e.Handler().ServeHTTP(w, r)
				return
			}
		}
		w.WriteHeader(http.StatusOK)
	})
	mux.Handle("/", handlers[0])
	return mux
}
