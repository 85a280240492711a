#!/usr/bin/env bash
# Installs one vLLM release from PyPI into a cached virtual environment outside the repository,
# as a user's engine image has it, and prints that environment's python.
#   hack/vllm-venv.sh 0.33.0
# The plugin's tests run on every release in VLLM_TESTED_VERSIONS (hack/test-plugin.sh). A cold
# install is about 12 minutes here (torch and its CUDA libraries, ~10 GB, though no GPU is used).
set -euo pipefail
version="${1:?usage: hack/vllm-venv.sh VLLM_VERSION}"
cache="${PDCLUSTER_CACHE:-${HOME}/.cache/pdcluster}"
venv="${cache}/venv/vllm-${version}"
python="${PYTHON:-python3}"
if [[ -f "${venv}/.installed" ]] && [[ -x "${venv}/bin/python" ]]; then
	echo "${venv}/bin/python"
	exit 0
fi
rm -rf "${venv}"
mkdir -p "$(dirname "${venv}")"
start=$(date +%s)
echo "installing vLLM ${version} into ${venv} (cold: about 12 minutes)" >&2
"${python}" -m venv "${venv}" >&2
"${venv}/bin/python" -m pip install -q "vllm==${version}" >&2
got=$("${venv}/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))')
if [[ "${got}" != "${version}" ]]; then
	echo "vllm-venv: asked for vLLM ${version}, got ${got}" >&2
	exit 1
fi
touch "${venv}/.installed"
echo "vLLM ${version} installed in $(($(date +%s) - start)) s" >&2
echo "${venv}/bin/python"
