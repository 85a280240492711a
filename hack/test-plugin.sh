#!/usr/bin/env bash
# The completion-gate plugin's tests (connector/vllm/tests), on every tested vLLM release, each
# installed from PyPI by hack/vllm-venv.sh. A release that cannot be installed fails the run:
# the tests never skip for want of vLLM.
#
# Move the pins: edit VLLM_TESTED_VERSIONS here and TESTED in connector/vllm/pdgate/_vllm.py (a
# test checks they agree), measure the new release's stock Mooncake worker
# (STOCK_REPORTS_EMPTY_PULLS in tests/test_realvllm.py), run make test-plugin, and update
# "Supported vLLM versions" in docs/completion-gate.md.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_TESTED_VERSIONS="${VLLM_TESTED_VERSIONS:-0.30.0 0.33.0}"
for version in ${VLLM_TESTED_VERSIONS}; do
	python=$(hack/vllm-venv.sh "${version}")
	echo "== plugin tests on vLLM ${version}"
	# HF_HUB_OFFLINE: the tests' model is a local config.json; nothing is downloaded.
	(cd connector/vllm && HF_HUB_OFFLINE=1 PDGATE_TESTED_VERSIONS="${VLLM_TESTED_VERSIONS}" \
		"${python}" -m unittest discover -s tests -t .)
done
