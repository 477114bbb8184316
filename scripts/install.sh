#!/usr/bin/env bash
# Install lightning-hybrid (editable) with optional extras, without pulling a multi-GB CUDA build of torch onto a
# machine that has no GPU.
#
#   bash scripts/install.sh          # the package and its dependencies
#   bash scripts/install.sh test     # ... plus the test extras (pytest, transformers, ...)
#   bash scripts/install.sh test,hf  # several extras, comma-separated
#
# torch comes first, because the package's unpinned `torch>=2.11,<2.15` requirement would otherwise take the default
# (CUDA) wheel:
#   * torch already installed (e.g. the CUDA build a GPU user installed first): kept as it is;
#   * no torch and an NVIDIA driver (nvidia-smi) present: the default build of the supported range;
#   * no torch and no GPU: torch==2.13.0, the version tested on CPU.
# Set TORCH_SPEC to choose the torch requirement yourself, and PIP_INDEX_URL / PIP_EXTRA_INDEX_URL as usual to take
# it from another index (e.g. PyTorch's CPU-only wheel index).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
EXTRAS="${1:-}"

if ! "$PYTHON" -m pip --version >/dev/null 2>&1; then
    echo "error: '$PYTHON -m pip' is not available. Install pip for $PYTHON (or activate a virtual environment)." >&2
    exit 1
fi
"$PYTHON" - <<'PY'
import sys
if sys.version_info < (3, 10):
    sys.exit(f"error: lightning-hybrid needs Python 3.10 or newer, this is {sys.version.split()[0]}")
PY

pip_install() {
    "$PYTHON" -m pip install --no-input --progress-bar off "$@"
}
# Offline first: when every requirement is installed already (CI on a machine it ran on before, a developer running
# the script again) pip resolves them from the environment and the build backend installed, without reading the index
# for each of ~60 packages (100 s here for an install that changed nothing); anything missing, and it goes online.
pip_install_offline_first() {
    pip_install --no-index --no-build-isolation "$@" >/dev/null 2>&1 || pip_install "$@"
}

if installed=$("$PYTHON" -c "import torch; print(torch.__version__)" 2>/dev/null); then
    echo "install.sh: keeping the installed torch $installed"
elif [[ -n "${TORCH_SPEC:-}" ]]; then
    echo "install.sh: installing $TORCH_SPEC"
    pip_install "$TORCH_SPEC"
elif command -v nvidia-smi >/dev/null 2>&1; then
    echo "install.sh: NVIDIA driver found, installing the default (CUDA) torch build"
    pip_install "torch>=2.11,<2.15"
else
    echo "install.sh: no GPU found, installing torch==2.13.0 (the version tested on CPU)"
    pip_install "torch==2.13.0"
fi

# DeepSpeed (test and bench extras) builds from source; its C++ ops are compiled on first use instead (DS_BUILD_OPS=0)
export DS_BUILD_OPS="${DS_BUILD_OPS:-0}"
if [[ -n "$EXTRAS" ]]; then
    pip_install_offline_first -e ".[$EXTRAS]"
else
    pip_install_offline_first -e .
fi
if [[ ",$EXTRAS," =~ ,test, ]]; then
    # litgpt (the tests train its GPT unchanged) without its dependencies: it pins huggingface-hub<1.4, which
    # transformers 5 (>=1.31) excludes, and psutil; what its GPT and Config need is installed already
    pip_install_offline_first --no-deps "litgpt==0.5.13"
fi
# DeepSpeed's ops, built here once (cached in ~/.cache/torch_extensions) rather than inside the first training run or
# test session, in the one interpreter that then prints the versions (each start imports torch and DeepSpeed again):
# * on CPU its shared-memory all-reduce op, compiled the first time a process group starts (~1.5 min);
# * the CPU Adam op offload_optimizer=True steps with (~1 min).
BUILD_SHM_OP=0 BUILD_CPU_ADAM=0
if [[ ",$EXTRAS," =~ ,(test|bench), ]] && ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "install.sh: building DeepSpeed's CPU communication op (once; cached)"
    BUILD_SHM_OP=1
fi
if [[ ",$EXTRAS," =~ ,(test|bench|deepspeed), ]]; then
    echo "install.sh: building DeepSpeed's CPU Adam op (once; cached)"
    BUILD_CPU_ADAM=1
fi
BUILD_SHM_OP=$BUILD_SHM_OP BUILD_CPU_ADAM=$BUILD_CPU_ADAM "$PYTHON" - <<'PY'
import os

stdout = os.dup(1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the builders' compiler output, theirs and their subprocesses'
try:
    if os.environ["BUILD_SHM_OP"] == "1":
        os.environ["DS_ACCELERATOR"] = "cpu"
        from deepspeed.comm.torch import build_shm_op

        build_shm_op()
    if os.environ["BUILD_CPU_ADAM"] == "1":
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load(verbose=False)
finally:
    os.dup2(stdout, 1)

import lightning
import torch

import lightning_hybrid

print(f"install.sh: torch {torch.__version__}, lightning {lightning.__version__}, lightning-hybrid {lightning_hybrid.__version__}")
PY
