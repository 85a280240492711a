#!/usr/bin/env bash
# The completion-gate plugin's tests (connector/vllm/tests), on every tested vLLM release, each
# installed from PyPI by hack/vllm-venv.sh. A release that cannot be installed fails the run:
# the tests never skip for want of vLLM.
#
# The releases are the Makefile's VLLM_TESTED_VERSIONS (make test-plugin passes them); moving a
# pin is described in docs/completion-gate.md, "Supported vLLM versions".
set -euo pipefail
cd "$(dirname "$0")/.."
: "${VLLM_TESTED_VERSIONS:?the vLLM releases to test on: run make test-plugin}" "${VLLM_ENGINE_VERSIONS?run make test-plugin}"
for version in ${VLLM_TESTED_VERSIONS}; do
	# The CPU build where VLLM_ENGINE_VERSIONS has the release: the same install the real engines
	# run on (test/realengine), so one environment per release.
	python=$(hack/vllm-venv.sh --tested "${version}")
	echo "== plugin tests on vLLM ${version}"
	# HF_HUB_OFFLINE: the tests' model is a local config.json; nothing is downloaded.
	(cd connector/vllm && HF_HUB_OFFLINE=1 PDGATE_TESTED_VERSIONS="${VLLM_TESTED_VERSIONS}" \
		"${python}" -m unittest discover -s tests -t .)
done
