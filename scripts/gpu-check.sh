#!/usr/bin/env bash
# The device path measured in one prepared run: `orchestrate bench device`, part by part, each in a
# process of its own under a time limit, its results as JSON files in --out (issue #44).
#
#   bash scripts/gpu-check.sh --device cpu --scale tiny --out /tmp/gpu-check   # here, ~2-3 min
#   bash scripts/gpu-check.sh --out "$OUT"                                       # an H200: cuda, h200
#
# On the GPU machine, through the device tool (/work/.library/device/README.md): first, here,
# `bash scripts/gpu-wheels.sh` (fills .whl/, ~28 MiB), then one `run` with
#   carry: [".whl"], timeout_s: 570,
#   command: SPRAWL_COMMIT=<git rev-parse --short HEAD> bash scripts/gpu-check.sh --out "$OUT"
# Estimated at 5-6 minutes there (not yet run on one); each part has a limit (LIMIT_S below), the
# parts before the summary BUDGET_S=500 s together, the summary 30 s more. It brings back 7
# files: device.json (machine, versions, sizes, each part's status, the targets),
# tests.json, codec.json, publish.json, trainer.json, engine.json and gpu-check.log. Figures go
# to docs/benchmarks.md ("On an H200") with the commit and this command.
#
# With .whl/ present (and Python 3.12, the wheels' own) its wheels are installed with
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl
# and /tmp/site goes first on PYTHONPATH. A part that fails or runs out of time leaves its file
# with "status": "error" or "running" (its figures so far); the next part still runs. Options:
# --device cpu|cuda (cuda), --scale tiny|h200 (h200), --out DIR ($TMPDIR/gpu-check), --work DIR
# (models and boards; $TMPDIR/sprawl-bench-device), --set FIELD=VALUE (a size; repeatable),
# --parts "codec publish" (only those, then the summary: a rerun of what failed).
# Exit status: 1 if a part failed or timed out, else 0.
set -uo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
DEVICE=cuda
SCALE=h200
OUT="${TMPDIR:-/tmp}/gpu-check"
WORK="${TMPDIR:-/tmp}/sprawl-bench-device"
SETS=()
PARTS="env tests codec publish trainer engine"
while (($#)); do
    case "$1" in
        --device) DEVICE="$2"; shift 2 ;;
        --scale) SCALE="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --work) WORK="$2"; shift 2 ;;
        --set) SETS+=(--set "$2"); shift 2 ;;
        --parts) PARTS="$2"; shift 2 ;;
        *) echo "gpu-check: unknown option $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
if [[ -n "${PYTHON:-}" ]]; then :
elif [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python
else PYTHON=python3
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
exec > >(tee -a "$OUT/gpu-check.log") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1  # nothing to reach there
START=$SECONDS
BUDGET_S="${BUDGET_S:-500}"

PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if compgen -G ".whl/*.whl" >/dev/null && [[ "$PYVER" != 3.12 ]]; then
    echo "gpu-check: .whl/ holds wheels for Python 3.12, $PYTHON is $PYVER: not installed"
elif compgen -G ".whl/*.whl" >/dev/null; then
    echo "gpu-check: installing $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

failed=0
part() {  # part NAME LIMIT_S [budget]: one part of the bench, at most LIMIT_S (and the budget)
    local name="$1" limit="$2" left=$((BUDGET_S - (SECONDS - START)))
    [[ "${3:-budget}" == budget ]] && ((limit > left)) && limit=$left
    if ((limit < 10)); then
        echo "gpu-check: $name skipped: the budget of ${BUDGET_S} s is spent"; failed=1; return
    fi
    echo "gpu-check: $name (at most ${limit} s, $((SECONDS - START)) s in)"
    timeout -k 10 "$limit" "$PYTHON" -m orchestrator.cli bench device "$name" \
        --device "$DEVICE" --scale "$SCALE" --out "$OUT" --work "$WORK" "${SETS[@]}"
    local rc=$?
    ((rc == 124 || rc == 137)) && echo "gpu-check: $name ran out of its ${limit} s"
    ((rc != 0)) && failed=1
}

declare -A LIMIT_S=([env]=60 [tests]=90 [codec]=130 [publish]=150 [trainer]=130 [engine]=90)
timeout 120 "$PYTHON" -m policies.codec.warm  # numba's kernels compiled and cached, untimed
for name in $PARTS; do
    part "$name" "${LIMIT_S[$name]:-120}"
done
part summary 30 always
echo "gpu-check: done in $((SECONDS - START)) s; results in $OUT"
exit $failed
