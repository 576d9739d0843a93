#!/usr/bin/env bash
# What the speed and memory work needs measured next, for a short GPU lease, in one or two calls.
#
#   SESSION_PARTS=kit bash bench/device/session.sh OUTDIR       # call 1, ~4.5 min (time limit 300 s)
#   SESSION_PARTS=fit,host bash bench/device/session.sh OUTDIR  # call 2 on the warm machine, ~6 min (400 s)
#   bash bench/device/session.sh --rehearse OUTDIR              # here, on the CPU (tiny shapes), ~75 s
#
# The parts, in order, each bounded by its own time limit (so a call ends in time whatever hangs):
# kit:  the kit's lightning, throughput and pytest_gpu stages (check.sh, KIT_BUDGET_S=${SESSION_KIT_S:-240});
# fit:  the fit at b32 x 1024 (lazytrain, auto, FSDP2 CPU offload; stage_fit.py, ${SESSION_B32_S:-190} s),
#       then at b8 x 1024 (the same three, ${SESSION_B8_S:-135} s);
# host: the host kernels against torch's on the host's threads (bench_host_ops.py 8,16, one round);
# step: (not in the default parts) lazytrain alone at b32 with its updates after the backward
#       (--updates-at-step, ${SESSION_STEP_S:-85} s): what the updates in the backward gain, next to fit's
#       b32 lazytrain (files fit-b32-step.json/.log; call 2 with SESSION_PARTS=fit,step,host: 8 files).
# OUTDIR gets at most 7 flat files (a lent machine returns at most 8, two folders deep at most): kit.json,
# kit.log, fit-b32.json, fit-b32.log, fit-b8.json, fit-b8.log, host-ops.log. The kit's wheels install
# once into $KIT_SITE (default /tmp/lazytrain-kit-site) and stay for the later parts and calls.
# Environment: SESSION_PARTS (default kit,fit,host: ~10 minutes, over one call's 600 s limit on some
# machines), PYTHON (as check.sh), SESSION_KIT_S, SESSION_B32_S, SESSION_B8_S, SESSION_STEP_S, SESSION_VARIANTS (default
# lazytrain,auto,fsdp2_offload; add deepspeed_offload when the time allows), SESSION_KIT_ONLY (the kit part's
# stages, default lightning,throughput,pytest_gpu), KIT_FIT_CPROFILE=1 (the
# training loop thread's profile of lazytrain's timed steps).
set -uo pipefail

REHEARSE=""
OUT=""
for arg in "$@"; do
  case "$arg" in
    --rehearse) REHEARSE="--rehearse" ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    -*) echo "unknown option $arg" >&2; exit 2 ;;
    *) OUT="$arg" ;;
  esac
done
[ -n "$OUT" ] || { echo "usage: bash bench/device/session.sh [--rehearse] OUTDIR" >&2; exit 2; }
KIT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$KIT_DIR/../.." && pwd)"
mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/lazytrain-session.XXXXXX")"
export KIT_SITE="${KIT_SITE:-/tmp/lazytrain-kit-site}" KIT_KEEP_SITE=1 PYTHONUNBUFFERED=1
PY="${PYTHON:-$(command -v python3 || command -v python)}"
VARIANTS="${SESSION_VARIANTS:-lazytrain,auto,fsdp2_offload}"
if [ -n "$REHEARSE" ]; then
  DEV=cpu B32=2 B8=2 SEQ=32 THREADS=1,2 HOST_MIB=32  # the plumbing: 256 MiB overran 40 s on a busy 2-core machine
else
  DEV=cuda B32=32 B8=8 SEQ=1024 THREADS=8,16 HOST_MIB=256
fi
T0=$(date +%s)
say() { echo "[session +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/kit.log"; }
cd "$REPO" || exit 2
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >>"$OUT/kit.log" 2>&1

PARTS=",${SESSION_PARTS:-kit,fit,host},"
if [[ "$PARTS" == *,kit,* ]]; then
  say "kit: ${SESSION_KIT_ONLY:-lightning,throughput,pytest_gpu}"
  KIT_ONLY="${SESSION_KIT_ONLY:-lightning,throughput,pytest_gpu}" KIT_BUDGET_S="${SESSION_KIT_S:-240}" \
    timeout $(( ${SESSION_KIT_S:-240} + 30 )) bash "$KIT_DIR/check.sh" $REHEARSE "$WORK/kit" >>"$OUT/kit.log" 2>&1
  cp "$WORK/kit/results.json" "$OUT/kit.json" 2>/dev/null
  cat "$WORK/kit/log.txt" >>"$OUT/kit.log" 2>/dev/null
elif [ -z "$REHEARSE" ] && [ ! -d "$KIT_SITE" ]; then  # a fresh machine: the later parts need the carried packages
  say "installing the carried wheels into $KIT_SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$KIT_SITE" \
    "$KIT_DIR"/wheels/*.whl >>"$OUT/kit.log" 2>&1 || say "pip install of the wheels failed (see kit.log)"
fi
export PYTHONPATH="$KIT_SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"

fit() {  # label batch seconds
  say "fit $1"
  timeout $(( $3 + 15 )) "$PY" "$KIT_DIR/stage_fit.py" --device $DEV --out "$WORK/fit-$1.json" --workdir "$WORK/fit-$1" \
    --batch "$2" --seq $SEQ --warmup 1 --variants "$VARIANTS" --budget "$3" >"$OUT/fit-$1.log" 2>&1
  cp "$WORK/fit-$1.json" "$OUT/fit-$1.json" 2>/dev/null || say "fit $1 wrote no result (see fit-$1.log)"
}
if [[ "$PARTS" == *,fit,* ]]; then
  fit b32 $B32 "${SESSION_B32_S:-190}"
  fit b8 $B8 "${SESSION_B8_S:-135}"
fi
if [[ "$PARTS" == *,step,* ]]; then
  say "fit b32, lazytrain with its updates after the backward"
  timeout $(( ${SESSION_STEP_S:-85} + 15 )) "$PY" "$KIT_DIR/stage_fit.py" --device $DEV --out "$WORK/fit-b32-step.json" \
    --workdir "$WORK/fit-b32-step" --batch $B32 --seq $SEQ --warmup 1 --variants lazytrain --updates-at-step \
    --budget "${SESSION_STEP_S:-85}" >"$OUT/fit-b32-step.log" 2>&1
  cp "$WORK/fit-b32-step.json" "$OUT/fit-b32-step.json" 2>/dev/null || say "fit b32 step wrote no result"
fi
if [[ "$PARTS" == *,host,* ]]; then
  say "host kernels"
  timeout 40 "$PY" "$REPO/bench/bench_host_ops.py" $THREADS --mib $HOST_MIB --rounds 1 --repeats 3 >"$OUT/host-ops.log" 2>&1
fi
rm -rf "$WORK"
say "done; files in $OUT"
ls "$OUT"
