#!/usr/bin/env bash
# The device validation kit: one call that proves the CUDA path on a lent GPU machine.
#
#   bash bench/device/check.sh OUTDIR              # on the GPU machine (no network): < 8 minutes
#   bash bench/device/check.sh --rehearse OUTDIR   # here, on the CPU: every stage that can run without CUDA
#
# 1. Packages: if any module the project needs is missing (the GPU image lacks pyomo, highspy,
#    hydra-core, omegaconf, bitsandbytes, jsonargparse), install the carried wheels of
#    bench/device/wheels/ (made by fetch_wheels.py) offline into $KIT_SITE (default OUTDIR/site):
#    `pip install --no-index --no-deps --target`; without pip, the wheels are unpacked (their
#    scripts, e.g. ninja, into $KIT_SITE/bin). DeepSpeed (the fit stage's peer) is optional: installed
#    when carried, else that variant records skipped.
#    PYTHONPATH=$KIT_SITE:<repo root>. OUTDIR/site is removed at the end (it would travel back
#    with the results) unless KIT_KEEP_SITE=1.
#    The wheels are for one CPython and platform (MANIFEST.json's python_tag, e.g. cp312, and the
#    compiled wheels' names: cp312-cp312-manylinux_..._x86_64): a device interpreter of another
#    version or machine stops the kit here (exit 2, with the fix) instead of failing later on an import.
# 2. $PYTHON bench/device/run_checks.py [--rehearse] OUTDIR: the stages, each in its own process
#    (started with the same interpreter) with its own timeout; OUTDIR/results.json and OUTDIR/log.txt.
# Exit status: 0 when no stage failed; 1 when one did; 2 when the kit could not run.
# Environment: PYTHON (the interpreter with torch for every step and stage; default: python3, else
# python, on PATH -- set it when that is not the one with torch), KIT_SITE, KIT_KEEP_SITE, KIT_BUDGET_S
# (seconds for all stages, default 450), KIT_ONLY (comma-separated stages), LAZYTRAIN_NVME_DIR,
# KIT_WHEELS (the wheel folder, default bench/device/wheels), KIT_NEEDED (the modules to check,
# space-separated; default: those the image lacks), KIT_OPTIONAL (modules installed from the wheels
# when missing, but not required; default: deepspeed).
set -uo pipefail

REHEARSE=()
OUT=""
for arg in "$@"; do
  case "$arg" in
    --rehearse) REHEARSE=(--rehearse) ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    -*) echo "unknown option $arg" >&2; exit 2 ;;
    *) OUT="$arg" ;;
  esac
done
if [ -z "$OUT" ]; then
  echo "usage: bash bench/device/check.sh [--rehearse] OUTDIR" >&2
  exit 2
fi

KIT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$KIT_DIR/../.." && pwd)"
mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
SITE="${KIT_SITE:-$OUT/site}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
if [ -z "$PY" ]; then
  echo "[check.sh] ERROR: no python3 or python on PATH; set PYTHON to the interpreter that has torch" >&2
  exit 2
fi
# The interpreter must run and have torch: a python3 on PATH that is another Python (not the venv or
# conda env with torch) would otherwise fail every stage on its imports.
PY_FROM="${PYTHON:+PYTHON}"
PY_FROM="${PY_FROM:-the first python3/python on PATH}"
PY_INFO="$("$PY" -c 'import importlib.util, sys; print(sys.version.split()[0], importlib.util.find_spec("torch") is not None, sys.executable)' 2>&1)"
PY_RC=$?
read -r PY_VERSION PY_TORCH PY_EXE <<<"$(printf '%s\n' "$PY_INFO" | tail -n 1)"
if [ $PY_RC -ne 0 ] || [ -z "${PY_EXE:-}" ]; then
  echo "[check.sh] ERROR: the interpreter $PY ($PY_FROM) does not run (exit $PY_RC): $(printf '%s' "$PY_INFO" | tail -n 3)" >&2
  echo "[check.sh] set PYTHON to the interpreter that has torch, e.g. PYTHON=/path/to/venv/bin/python bash bench/device/check.sh ..." >&2
  exit 2
fi
if [ "$PY_TORCH" != "True" ]; then
  echo "[check.sh] ERROR: $PY_EXE (Python $PY_VERSION, $PY_FROM) has no torch; set PYTHON to the interpreter that has torch" >&2
  exit 2
fi
PY="$PY_EXE"  # absolute: run_checks.py starts every stage with the same interpreter (sys.executable)
WHEELS="${KIT_WHEELS:-$KIT_DIR/wheels}"
T0=$(date +%s)
cd "$REPO" || exit 2

note() { echo "[check.sh] $*"; }
# OUTDIR/site would travel back with the results: removed at the end (unless KIT_KEEP_SITE=1) and
# after a failed install.
drop_site() { if [ "$SITE" = "$OUT/site" ] && [ "${KIT_KEEP_SITE:-0}" != "1" ]; then rm -rf "$SITE"; fi; }

# Modules the package and its tests import that the GPU image does not ship.
NEEDED="${KIT_NEEDED:-pyomo.environ highspy hydra omegaconf bitsandbytes jsonargparse docstring_parser typeshed_client antlr4}"
# Modules only some stages use (the fit stage's DeepSpeed peer): installed from the carried wheels when
# missing, but a kit without them still runs (that variant records skipped).
OPTIONAL="${KIT_OPTIONAL:-deepspeed}"
missing() {
  PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$@" <<'EOF'
import importlib.util, sys
miss = []
for name in sys.argv[1:]:
    top = name.split(".")[0]
    try:
        if importlib.util.find_spec(top) is None:
            miss.append(name)
    except Exception:
        miss.append(name)
print(" ".join(miss))
EOF
}

note "python: $PY ($PY_VERSION)"
MISSING="$(missing $NEEDED)" || { note "ERROR: $PY could not check the modules"; exit 2; }
OPT_MISSING="$(missing $OPTIONAL)" || OPT_MISSING=""
if [ -z "$MISSING" ] && [ -n "$OPT_MISSING" ]; then
  shopt -s nullglob
  opt_wheels=("$WHEELS"/*.whl)
  shopt -u nullglob
  if [ ${#opt_wheels[@]} -eq 0 ]; then
    note "optional modules missing: $OPT_MISSING (no wheels in $WHEELS): the stages that use them record skipped"
    OPT_MISSING=""
  fi
fi
if [ -n "$MISSING" ] || [ -n "$OPT_MISSING" ]; then
  shopt -s nullglob
  wheels=("$WHEELS"/*.whl)
  if [ ${#wheels[@]} -eq 0 ]; then
    note "missing modules: $MISSING, and no wheels in $WHEELS: run 'python bench/device/fetch_wheels.py --python ${PY_VERSION%.*}' on a machine with pip access and carry bench/device/wheels"
    exit 2
  fi
  # The wheels fit one CPython on one machine: refuse another before installing anything.
  "$PY" - "$WHEELS" "${wheels[@]}" <<'EOF'
import json, platform, sys
from pathlib import Path

folder, wheels = Path(sys.argv[1]), sys.argv[2:]
here = f"cp{sys.version_info.major}{sys.version_info.minor}"
version = f"{sys.version_info.major}.{sys.version_info.minor}"
machine = platform.machine()
want, fetched, foreign = set(), None, []
manifest = folder / "MANIFEST.json"
if manifest.is_file():
    try:
        doc = json.loads(manifest.read_text())
        fetched = doc.get("python")
        if doc.get("python_tag"):
            want.add(doc["python_tag"])
    except (OSError, ValueError) as err:
        print(f"[check.sh] warning: {manifest} is not readable ({err}); judging by the wheel names")
for name in wheels:  # wheels built for one CPython's ABI name it: foo-1.0-cp312-cp312-manylinux_2_17_x86_64.whl
    parts = Path(name).name[:-len(".whl")].split("-")
    if len(parts) >= 5 and parts[-2].startswith("cp"):
        want |= {t for t in parts[-3].split(".") if t.startswith("cp")}
    plats = parts[-1].split(".") if len(parts) >= 5 else ["any"]
    if "any" not in plats and not any(p.endswith("_" + machine) and p.startswith(("manylinux", "linux"))
                                      for p in plats):
        foreign.append(Path(name).name)
fix = (f"Fix: on a machine with pip access run 'python bench/device/fetch_wheels.py --python {version}' "
       f"(wheels for Python {version} on manylinux {machine}) and carry the new bench/device/wheels")
if want and want != {here}:
    print(f"[check.sh] ERROR: the carried wheels in {folder} were fetched for {', '.join(sorted(want))}"
          + (f" (Python {fetched})" if fetched else "")
          + f", but this machine's Python is {sys.version.split()[0]} ({here}, {sys.executable}). {fix}, "
          f"or set PYTHON to a Python {fetched or 'matching ' + ', '.join(sorted(want))} on this machine.")
    sys.exit(2)
if foreign:
    print(f"[check.sh] ERROR: the carried wheels {foreign} in {folder} are not for this machine "
          f"({sys.platform}, {machine}). {fix}.")
    sys.exit(2)
print(f"[check.sh] the wheels are for {', '.join(sorted(want)) or 'any Python (pure)'}; this Python is {here}")
EOF
  [ $? -eq 0 ] || exit 2
  note "missing modules: ${MISSING:-none needed}${OPT_MISSING:+ (optional: $OPT_MISSING)}; installing ${#wheels[@]} carried wheels into $SITE (offline)"
  mkdir -p "$SITE"
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install --no-index --no-deps --no-compile --disable-pip-version-check -q --target "$SITE" "${wheels[@]}" \
      || { note "pip install of the wheels failed"; drop_site; exit 2; }
  else
    note "no pip: unpacking the wheels into $SITE"
    "$PY" - "$SITE" "${wheels[@]}" <<'EOF' || { note "unpacking the wheels failed"; drop_site; exit 2; }
import os, sys, zipfile
site = sys.argv[1]
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            top, _, rest = info.filename.partition("/")
            if top.endswith(".data"):
                kind, _, name = rest.partition("/")
                if kind == "scripts" and name and "/" not in name and not info.is_dir():
                    # executables (ninja, for DeepSpeed's JIT build) go to SITE/bin, as pip --target puts them
                    path = os.path.join(site, "bin", name)
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    with open(path, "wb") as f:
                        f.write(z.read(info))
                    os.chmod(path, 0o755)
                continue  # headers and other data: not needed to import
            z.extract(info, site)
EOF
  fi
  MISSING="$(missing $NEEDED)" || { note "ERROR: $PY could not check the modules"; drop_site; exit 2; }
  if [ -n "$MISSING" ]; then
    note "still missing after installing the wheels: $MISSING (the wheel list is incomplete)"
    drop_site
    exit 2
  fi
  OPT_MISSING="$(missing $OPTIONAL)" || OPT_MISSING=""
  [ -z "$OPT_MISSING" ] || note "optional modules still missing: $OPT_MISSING (not carried): the stages that use them record skipped"
  note "installed in $(( $(date +%s) - T0 )) s"
else
  note "every needed module is importable: no wheels installed"
fi

export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
"$PY" "$KIT_DIR/run_checks.py" "${REHEARSE[@]}" "$OUT"
rc=$?
drop_site
note "exit $rc after $(( $(date +%s) - T0 )) s; results in $OUT/results.json"
exit $rc
