#!/usr/bin/env bash
# Download, as wheels into .whl/, the packages sprawl needs on the GPU machine beyond its image.
#
#   bash scripts/gpu-wheels.sh                       # versions of .venv/bin/python's packages
#   PYTHON=/path/to/venv/bin/python bash scripts/gpu-wheels.sh
#
# The GPU machine (an H200 lent through the device tool; /work/.library/device/README.md) runs
# Python 3.12 with PyTorch, Triton, numba, numpy, pyarrow, aiohttp, accelerate, tokenizers,
# safetensors and more, but reaches no package index. What sprawl's runtime (and its CUDA tests'
# conftest) imports that the image lacks, or holds too old a version of (transformers 5.17 there,
# sprawl needs >= 5.20; huggingface-hub 1.x, transformers 5.25 needs 2.4), travels as wheels in
# .whl/ (named in the run's carry; ignored by git), each at the version this checkout's
# environment runs, for CPython 3.12 on manylinux x86_64, no dependencies resolved (the list
# below is the closure the image lacks). scripts/gpu-check.sh installs them with
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl
# and puts /tmp/site first on PYTHONPATH. Not carried: torch, numba and llvmlite (the image's;
# llvmlite alone would pass the 64 MiB a run can carry), pyarrow and pandas (the image's).
# .whl/ is replaced whole, one version of each package; the script fails past $LIMIT_MIB.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
DEST="$REPO/.whl"
LIMIT_MIB="${LIMIT_MIB:-48}"   # the tree and the wheels travel together, at most 64 MiB

PACKAGES=(
    transformers huggingface-hub httpx2 httpcore2 truststore h11 anyio idna click regex
    kernels tomlkit typing-extensions peft pydantic pydantic-core annotated-types
    typing-inspection structlog zstandard gguf trio outcome sniffio datasets dill multiprocess
)

# NAME==VERSION of each, as installed for $PYTHON (what the tests here ran against).
mapfile -t PINS < <("$PYTHON" - "${PACKAGES[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

missing = []
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        missing.append(name)
if missing:
    sys.exit(f"gpu-wheels: not installed for {sys.executable}: {' '.join(missing)}")
EOF
)

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d "$TMP" "${PINS[@]}"

size_mib=$(( $(du -sb "$TMP" | cut -f1) / 1048576 ))
if (( size_mib > LIMIT_MIB )); then
    echo "gpu-wheels: the wheels come to $size_mib MiB, over LIMIT_MIB=$LIMIT_MIB" >&2
    exit 1
fi
rm -rf "$DEST"
mkdir -p "$DEST"
mv "$TMP"/*.whl "$DEST"/
echo "gpu-wheels: $(ls "$DEST" | wc -l) wheels, $size_mib MiB in $DEST" >&2
