#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU) for `orchestrate sidecar --engine-kind llamacpp` and print
# the binary's path:
#   ${SPRAWL_ENGINE_CACHE:-$HOME/.cache/sprawl/engines}/llama.cpp-<version>/bin/llama-server
#
# The source is the llama.cpp tree vendored in the llama-cpp-python sdist on PyPI (0.3.36 =
# llama.cpp commit 0c1e5709), which sprawl's llama.cpp backend was written and tested against.
#
# * Idempotent: exits at once when the cached binary exists and runs (`--version`).
# * The only network access is `pip download` of the sdist (PyPI, or the index pip is set up
#   with; LLAMA_SDIST skips it). cmake configure + build are offline: every download in
#   llama.cpp's CMake is off (-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF
#   -DLLAMA_OPENSSL=OFF, no BoringSSL/LibreSSL/llguidance/KleidiAI fetches), FetchContent is
#   fully disconnected, and when `unshare -n` works (root or user namespaces) they run in an
#   empty network namespace, so an attempted download fails instead of succeeding silently.
# * The cache lives outside the clone and is filled atomically (temp dir + mv).
# * Static: the binary needs only libc / libstdc++ / libgomp / libm.
# * Build deps: cmake, g++, tar, python3 (ninja if present). ~10 min on 2 cores.
#
# Env knobs:
#   LLAMA_CPP_PYTHON_VERSION  sdist version to build (default 0.3.36)
#   SPRAWL_ENGINE_CACHE       cache root (default ~/.cache/sprawl/engines)
#   LLAMA_NATIVE              ON (default: -march=native, fastest, tied to this CPU family) or
#                             OFF (a portable x86-64 baseline, for a binary shared between hosts)
#   LLAMA_JOBS                parallel build jobs (default: nproc)
#   LLAMA_SDIST               path to an already-downloaded sdist (no network at all)
#   LLAMA_KEEP_BUILD=1        keep the temp build dir (its path is printed)
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE_ROOT="${SPRAWL_ENGINE_CACHE:-$HOME/.cache/sprawl/engines}"
PREFIX="$CACHE_ROOT/llama.cpp-$VERSION"
BIN="$PREFIX/bin/llama-server"
NATIVE="${LLAMA_NATIVE:-ON}"
JOBS="${LLAMA_JOBS:-$(nproc 2>/dev/null || echo 2)}"

log() { printf '[build-llama-server] %s\n' "$*" >&2; }

if [[ -x "$BIN" ]] && "$BIN" --version >/dev/null 2>&1; then
    log "cached: $BIN"
    echo "$BIN"
    exit 0
fi

for tool in cmake g++ tar python3; do
    command -v "$tool" >/dev/null || { log "missing $tool (Debian: apt-get install cmake g++ python3)"; exit 1; }
done
GENERATOR=()
if command -v ninja >/dev/null; then GENERATOR=(-G Ninja); fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/sprawl-llama-build.XXXXXX")"
cleanup() { if [[ "${LLAMA_KEEP_BUILD:-0}" != 1 ]]; then rm -rf "$WORK"; else log "kept $WORK"; fi; }
trap cleanup EXIT

# 1. the sdist (--no-binary llama-cpp-python: the source tarball, --no-deps)
if [[ -n "${LLAMA_SDIST:-}" ]]; then
    SDIST="$LLAMA_SDIST"
else
    # --no-binary llama-cpp-python: the sdist for this package (pip still prepares its
    # metadata, which installs scikit-build-core into an isolated env; as wheels this takes
    # seconds, with `--no-binary :all:` it is built from source too, ~1 min).
    log "pip download llama-cpp-python==$VERSION (sdist)"
    python3 -m pip download --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$VERSION" -d "$WORK/dl" >&2
    SDIST="$(ls "$WORK"/dl/llama_cpp_python-"$VERSION".tar.gz)"
fi

# 2. extract only the vendored llama.cpp tree + its git metadata (for the commit id)
TOP="llama_cpp_python-$VERSION"
log "extracting $TOP/vendor/llama.cpp"
tar -xzf "$SDIST" -C "$WORK" "$TOP/vendor/llama.cpp" "$TOP/.git/modules/vendor/llama.cpp" 2>/dev/null \
    || tar -xzf "$SDIST" -C "$WORK" "$TOP/vendor/llama.cpp"
SRC="$WORK/$TOP/vendor/llama.cpp"
COMMIT="unknown"
if [[ -f "$WORK/$TOP/.git/modules/vendor/llama.cpp/HEAD" ]]; then
    COMMIT="$(tr -d '[:space:]' < "$WORK/$TOP/.git/modules/vendor/llama.cpp/HEAD")"
fi
log "llama.cpp commit: $COMMIT"

# 3. configure + build offline
NET=()
if unshare -n true 2>/dev/null; then NET=(unshare -n); log "configure/build in an empty network namespace"; fi

CMAKE_ARGS=(
    -S "$SRC" -B "$WORK/build" "${GENERATOR[@]}"
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE="$NATIVE"
    -DGGML_BACKEND_DL=OFF
    -DGGML_CPU_KLEIDIAI=OFF
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_BORINGSSL=OFF
    -DLLAMA_BUILD_LIBRESSL=OFF
    -DLLAMA_LLGUIDANCE=OFF
    -DLLAMA_BUILD_COMMIT="${COMMIT:0:8}"
    -DLLAMA_BUILD_NUMBER=0
    -DFETCHCONTENT_FULLY_DISCONNECTED=ON
    -DCMAKE_WARN_UNUSED_CLI=NO
)
START=$(date +%s)
log "cmake configure"
"${NET[@]}" cmake "${CMAKE_ARGS[@]}" > "$WORK/configure.log" 2>&1 || { cat "$WORK/configure.log" >&2; exit 1; }
log "cmake --build --target llama-server -j $JOBS"
"${NET[@]}" cmake --build "$WORK/build" --config Release --target llama-server -j "$JOBS" > "$WORK/build.log" 2>&1 \
    || { tail -50 "$WORK/build.log" >&2; exit 1; }
END=$(date +%s)

# no download may have happened (belt and braces on top of the network namespace)
if grep -Eiq 'downloading|FetchContent_Populate|Populating |file\(DOWNLOAD' "$WORK/configure.log" "$WORK/build.log"; then
    log "a download was attempted during the build:"; grep -Ei 'download|populat' "$WORK/configure.log" "$WORK/build.log" >&2
    exit 1
fi

# 4. install into the cache atomically
STAGE="$PREFIX.tmp.$$"
rm -rf "$STAGE"; mkdir -p "$STAGE/bin"
cp "$WORK/build/bin/llama-server" "$STAGE/bin/llama-server"
SHARED="$(ldd "$STAGE/bin/llama-server" | grep -E 'libllama|libggml|libmtmd' || true)"
if [[ -n "$SHARED" ]]; then log "unexpected shared llama libs: $SHARED"; exit 1; fi
cp "$WORK/configure.log" "$WORK/build.log" "$STAGE/"
python3 - "$STAGE/BUILD_INFO.json" <<EOF
import json, sys
json.dump({
    "llama_cpp_python": "$VERSION",
    "llama_cpp_commit": "$COMMIT",
    "ggml_native": "$NATIVE",
    "build_seconds": $((END - START)),
    "jobs": $JOBS,
    "cmake_args": $(python3 -c 'import json,sys; print(json.dumps(sys.argv[1:]))' "${CMAKE_ARGS[@]:4}"),
}, open(sys.argv[1], "w"), indent=2)
EOF
"$STAGE/bin/llama-server" --version >&2
mkdir -p "$CACHE_ROOT"
rm -rf "$PREFIX"; mv "$STAGE" "$PREFIX"
log "built in $((END - START)) s -> $BIN"
echo "$BIN"
