package vllm

// vLLM's own words: the names its command line, environment, OpenAI server and P/D connectors
// use, which render, the router and the stand-ins must spell as vLLM does. They live here, in
// one leaf package, so that a vLLM rename is one edit (and the Python plugin beside them uses
// the same release's words).

// KVRole is vLLM's kv_role of an engine and of its connector (--kv-transfer-config).
type KVRole string

const (
	// KVProducer computes the prompt's KV cache and serves it (prefill).
	KVProducer KVRole = "kv_producer"
	// KVConsumer pulls that KV cache and generates (decode).
	KVConsumer KVRole = "kv_consumer"
)

// Ports vLLM binds unless told otherwise.
const (
	// APIPort is `vllm serve`'s default --port, the OpenAI server.
	APIPort int32 = 8000
	// MooncakeBootstrapPort is VLLM_MOONCAKE_BOOTSTRAP_PORT's default: a Mooncake producer
	// serves its bootstrap server (engine ids, transfer addresses) there.
	MooncakeBootstrapPort int32 = 8998
	// NixlSideChannelPort is VLLM_NIXL_SIDE_CHANNEL_PORT's default: each engine listens for NIXL
	// handshakes on it plus its data-parallel rank.
	NixlSideChannelPort int32 = 5600
	// KVEventsPort and KVEventsReplayPort are where the operator has an engine publish its
	// KV cache events and replay them (--kv-events-config's endpoint and replay_endpoint;
	// vLLM adds the data-parallel rank to both). 5557 is vLLM's example endpoint; vLLM has
	// no default replay port.
	KVEventsPort       int32 = 5557
	KVEventsReplayPort int32 = 5757
)

// FlagKVEventsConfig is `vllm serve`'s flag for KV cache events (KVEventsConfig as JSON).
const FlagKVEventsConfig = "--kv-events-config"

// KVEventsTopic is the topic the operator has engines publish KV cache events on.
const KVEventsTopic = "kv"

// KVEventsConfig is vLLM's KVEventsConfig (config/kv_events.py) as --kv-events-config takes it.
type KVEventsConfig struct {
	EnableKVCacheEvents bool   `json:"enable_kv_cache_events"`
	Publisher           string `json:"publisher"`
	Endpoint            string `json:"endpoint"`
	ReplayEndpoint      string `json:"replay_endpoint"`
	Topic               string `json:"topic"`
}

// `vllm serve`'s flags for an engine replica across several pods (engine/arg_utils.py).
const (
	// Data parallelism across pods, hybrid load balancing: every pod serves its own ranks.
	FlagDataParallelSizeLocal = "--data-parallel-size-local"
	FlagDataParallelStartRank = "--data-parallel-start-rank"
	FlagDataParallelAddress   = "--data-parallel-address"
	FlagDataParallelRPCPort   = "--data-parallel-rpc-port"
	FlagDataParallelHybridLB  = "--data-parallel-hybrid-lb"
	// The model across pods (multiprocessing backend): the leader serves, the others run
	// --headless.
	FlagNNodes        = "--nnodes"
	FlagNodeRank      = "--node-rank"
	FlagMasterAddr    = "--master-addr"
	FlagMasterPort    = "--master-port"
	FlagHeadless      = "--headless"
	FlagExecutor      = "--distributed-executor-backend"
	ExecutorMultiproc = "mp"

	// DataParallelRPCPort and MasterPort are vLLM's defaults of those flags.
	DataParallelRPCPort int32 = 29550
	MasterPort          int32 = 29501
)

// Environment variables LeaderWorkerSet's pod webhook sets in every container of a group.
const (
	EnvLWSLeaderAddress = "LWS_LEADER_ADDRESS"
	EnvLWSGroupSize     = "LWS_GROUP_SIZE"
	EnvLWSWorkerIndex   = "LWS_WORKER_INDEX"
)

// Environment variables vLLM reads.
const (
	EnvHostIP                = "VLLM_HOST_IP"
	EnvMooncakeBootstrapPort = "VLLM_MOONCAKE_BOOTSTRAP_PORT"
	EnvNixlSideChannelHost   = "VLLM_NIXL_SIDE_CHANNEL_HOST"
	EnvNixlSideChannelPort   = "VLLM_NIXL_SIDE_CHANNEL_PORT"
)

// The request body key the P/D connectors read, and its keys.
const (
	KVTransferParams    = "kv_transfer_params"
	DoRemoteDecode      = "do_remote_decode"
	DoRemotePrefill     = "do_remote_prefill"
	TransferID          = "transfer_id"
	RemoteBootstrapAddr = "remote_bootstrap_addr"
	RemoteEngineID      = "remote_engine_id"
	RemoteBlockIDs      = "remote_block_ids"
	RemoteHost          = "remote_host"
	RemotePort          = "remote_port"
)

// DataParallelRankHeader picks the data-parallel rank of a `vllm serve` that runs several.
const DataParallelRankHeader = "X-data-parallel-rank"

// Metrics vLLM exports on its API port's /metrics (prometheus_client adds _total to a counter).
const (
	// MetricPromptTokensBySource counts prompt tokens by where their KV came from, with label
	// MetricSourceLabel (one of the Source* values) beside model_name and engine (the DP rank).
	MetricPromptTokensBySource = "vllm:prompt_tokens_by_source_total"
	MetricSourceLabel          = "source"
	// SourceExternalKV: KV pulled from another engine (the P/D connector).
	SourceExternalKV = "external_kv_transfer"
	// SourceLocalCompute: prefilled here. On decode, vLLM computes the last prompt token here
	// even when the rest came from prefill.
	SourceLocalCompute = "local_compute"
	// SourceLocalCacheHit: found in this engine's prefix cache.
	SourceLocalCacheHit = "local_cache_hit"
)

// vLLM's serving metrics the chart's dashboard and the autoscaling examples read.
const (
	MetricNumRequestsRunning  = "vllm:num_requests_running"
	MetricNumRequestsWaiting  = "vllm:num_requests_waiting"
	MetricKVCacheUsage        = "vllm:kv_cache_usage_perc"
	MetricTimeToFirstToken    = "vllm:time_to_first_token_seconds"
	MetricInterTokenLatency   = "vllm:inter_token_latency_seconds"
	MetricE2ERequestLatency   = "vllm:e2e_request_latency_seconds"
	MetricMooncakeBytes       = "vllm:mooncake_bytes_transferred"
	MetricNixlBytes           = "vllm:nixl_bytes_transferred"
	MetricMooncakeXferSeconds = "vllm:mooncake_xfer_time_seconds"
	MetricNixlXferSeconds     = "vllm:nixl_xfer_time_seconds"
)

// The connectors' transfer counters: failed transfers and receives on decode, requests whose
// held KV expired on prefill (the abort timeout).
const (
	MetricMooncakeFailedTransfers = "vllm:mooncake_num_failed_transfers_total"
	MetricMooncakeFailedRecvs     = "vllm:mooncake_num_failed_recvs_total"
	MetricMooncakeExpired         = "vllm:mooncake_num_kv_expired_reqs_total"
	MetricNixlFailedTransfers     = "vllm:nixl_num_failed_transfers_total"
	MetricNixlFailedNotifications = "vllm:nixl_num_failed_notifications_total"
	MetricNixlExpired             = "vllm:nixl_num_kv_expired_reqs_total"
)

// The same counters, by what they count, for both connectors.
var (
	MetricFailedTransfers = []string{MetricMooncakeFailedTransfers, MetricNixlFailedTransfers}
	MetricFailedReceives  = []string{MetricMooncakeFailedRecvs, MetricNixlFailedNotifications}
	MetricExpiredRequests = []string{MetricMooncakeExpired, MetricNixlExpired}
)
