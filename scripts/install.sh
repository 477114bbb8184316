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
    pip_install -e ".[$EXTRAS]"
else
    pip_install -e .
fi
if [[ ",$EXTRAS," =~ ,test, ]]; then
    # litgpt (the tests train its GPT unchanged) without its dependencies: it pins huggingface-hub<1.4, which
    # transformers 5 (>=1.31) excludes, and psutil; what its GPT and Config need is installed already
    pip_install --no-deps "litgpt==0.5.13"
fi
if [[ ",$EXTRAS," =~ ,(test|bench), ]] && ! command -v nvidia-smi >/dev/null 2>&1; then
    # On CPU DeepSpeed compiles its shared-memory all-reduce op the first time a process group starts (~1.5 min,
    # cached in ~/.cache/torch_extensions): build it here, so that the first benchmark does not pay for it.
    echo "install.sh: building DeepSpeed's CPU communication op (once; cached)"
    DS_ACCELERATOR=cpu "$PYTHON" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null
fi
if [[ ",$EXTRAS," =~ ,(test|bench|deepspeed), ]]; then
    # offload_optimizer=True steps with DeepSpeed's CPU Adam op, also compiled on first use (~1 min, cached in
    # ~/.cache/torch_extensions): build it here once rather than inside the first training run (or test session)
    echo "install.sh: building DeepSpeed's CPU Adam op (once; cached)"
    "$PYTHON" -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False)" >/dev/null
fi
"$PYTHON" -c "import torch, lightning, lightning_hybrid; print(f'install.sh: torch {torch.__version__}, lightning {lightning.__version__}, lightning-hybrid {lightning_hybrid.__version__}')"
