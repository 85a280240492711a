#!/usr/bin/env bash
# Installs vLLM's own P/D router, vllm-router (a Rust router in a Python wheel), from PyPI into a
# cached virtual environment outside the repository, and prints its command: make bench runs it
# beside ours in front of the same stand-in engines (test/sandbox BenchmarkRouter). Cold: about
# 20 seconds and 130 MB.
set -euo pipefail
version="${VLLM_ROUTER_VERSION:-0.1.17}"
cache="${PDCLUSTER_CACHE:-${HOME}/.cache/pdcluster}"
venv="${cache}/venv/vllm-router-${version}"
mkdir -p "$(dirname "${venv}")"
# One install at a time: a second run waits for the first rather than deleting its work.
exec 9>"${venv}.lock"
flock 9
if [[ -f "${venv}/.installed" ]] && [[ -x "${venv}/bin/vllm-router" ]]; then
	echo "${venv}/bin/vllm-router"
	exit 0
fi
rm -rf "${venv}"
"${PYTHON:-python3}" -m venv "${venv}" >&2
"${venv}/bin/python" -m pip install -q --disable-pip-version-check "vllm-router==${version}" >&2
touch "${venv}/.installed"
echo "${venv}/bin/vllm-router"
