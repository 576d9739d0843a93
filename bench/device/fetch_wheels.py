"""Fetch the wheels a lent GPU machine lacks, once, on a development machine with pip access.

    python bench/device/fetch_wheels.py            # -> bench/device/wheels/ (git-ignored), prints the total

The GPU machine's image has torch, lightning, transformers, pytest, hypothesis and matplotlib (and
what they pull in); it has no network. This script ships the rest of what the project declares
(``pyproject.toml``: its dependencies and the ``train``, ``test`` and ``hf`` extras), with every
dependency of those that the image does not already hold, at the exact versions installed *here*:

  1. the closure of the project's requirements over the installed distributions' metadata, minus
     the closure of what the image has (``DEVICE_HAS``);
  2. each one as ``pip download --only-binary=:all: --no-deps name==version`` (this interpreter's
     tags: the device is assumed to run the same CPython minor version on manylinux x86_64);
     a distribution published only as an sdist (antlr4-python3-runtime 4.9.3) is built here with
     ``pip wheel --no-deps`` and must come out pure Python (``py3-none-any``);
  3. bitsandbytes is repacked: its wheel carries a native library for every CUDA/ROCm/XPU release
     (43 MB compressed). Kept: ``libbitsandbytes_cpu.so`` and the CUDA libraries named by
     ``--bnb-keep`` (default ``cuda128,cuda130``: the newest 12.x and the first 13.x; bitsandbytes
     loads the closest library of the runtime's major version, see its ``cextension.py``); every
     other ``libbitsandbytes_*.so`` is dropped and its line removed from ``RECORD``. The file keeps
     its name; ``MANIFEST.json`` records the repack and the libraries kept.

The folder must stay below ``--max-mib`` (60 MiB): the device call carries at most 64 MiB of
ignored files. The wheels are downloaded into a temporary folder and measured there; only a set
under the limit replaces the folder's wheels (an oversized set leaves the folder as it was and
exits 1). ``MANIFEST.json`` lists every wheel with its size and sha256, and the interpreter the
set was fetched for: ``python`` (``3.11``), ``python_tag`` (``cp311``: compiled wheels such as
highspy's and the sdist-built ones only fit that CPython) and ``platform``. ``check.sh`` refuses
(exit 2, with the fix) to install a set whose ``python_tag`` differs from the device's
interpreter, and installs exactly the ``*.whl`` files of the folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DEST = Path(__file__).resolve().parent / "wheels"
#: What the GPU machine's image is known to hold (with their own dependencies).
DEVICE_HAS = ("torch", "lightning", "transformers", "pytest", "hypothesis", "matplotlib")
#: Extras of this project that the kit needs (``train``: bitsandbytes, jsonargparse; ``test``; ``hf``).
EXTRAS = ("train", "test", "hf")
BNB_KEEP_DEFAULT = "cuda128,cuda130"
MIB = 1 << 20


def project_requirements() -> list[Requirement]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = data["project"]
    reqs = [Requirement(r) for r in project.get("dependencies", [])]
    for extra in EXTRAS:
        reqs += [Requirement(r) for r in project.get("optional-dependencies", {}).get(extra, [])]
    return reqs


def _applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": e}) for e in (extras or {""}))


def closure(roots: list[Requirement]) -> dict[str, str]:
    """{canonical name: installed version} of ``roots`` and everything they require here."""
    seen: dict[str, str] = {}
    todo: list[tuple[str, set[str]]] = [(r.name, set(r.extras)) for r in roots]
    extras_seen: dict[str, set[str]] = {}
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in seen and extras <= extras_seen.get(key, set()):
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is required but not installed here; install the project first "
                             f"(pip install -e '.[{','.join(EXTRAS)}]')") from None
        seen[key] = dist.version
        extras_seen.setdefault(key, set()).update(extras)
        for spec in dist.requires or []:
            req = Requirement(spec)
            if _applies(req, extras):
                todo.append((req.name, set(req.extras)))
    return seen


def wanted() -> dict[str, str]:
    ship = closure(project_requirements())
    has = closure([Requirement(n) for n in DEVICE_HAS])
    return {k: v for k, v in sorted(ship.items()) if k not in has and k != canonicalize_name("lightning-lazytrain")}


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def fetch_one(name: str, version: str, tmp: Path) -> tuple[Path, str]:
    out = tmp / canonicalize_name(name)
    out.mkdir()
    r = pip("download", "--only-binary=:all:", "--no-deps", "-d", str(out), f"{name}=={version}")
    how = "wheel"
    if r.returncode != 0:
        # sdist only: build it here; it must be pure Python to install on the device.
        r = pip("wheel", "--no-deps", "--no-binary", name, "-w", str(out), f"{name}=={version}")
        how = "built from sdist"
        if r.returncode != 0:
            raise SystemExit(f"could not get {name}=={version}:\n{r.stdout}\n{r.stderr}")
    wheels = list(out.glob("*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"{name}=={version}: expected one wheel, got {[w.name for w in wheels]}")
    if how != "wheel" and not wheels[0].name.endswith("-none-any.whl"):
        raise SystemExit(f"{wheels[0].name} was built from an sdist but is not pure Python")
    return wheels[0], how


def repack_bitsandbytes(wheel: Path, keep: list[str], dest: Path) -> list[str]:
    """Copy ``wheel`` to ``dest`` without the native libraries not in ``keep`` (+ cpu)."""
    keep_names = {f"libbitsandbytes_{k}.so" for k in ["cpu", *keep]}
    kept: list[str] = []
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        dropped: set[str] = set()
        for info in zin.infolist():
            base = info.filename.rsplit("/", 1)[-1]
            if base.startswith("libbitsandbytes_") and base.endswith(".so"):
                if base not in keep_names:
                    dropped.add(info.filename)
                    continue
                kept.append(base)
        for info in zin.infolist():
            if info.filename in dropped:
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = [ln for ln in data.decode().splitlines() if ln.split(",", 1)[0] not in dropped]
                data = ("\n".join(lines) + "\n").encode()
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    missing = keep_names - set(kept)
    if missing:
        raise SystemExit(f"bitsandbytes wheel has no {sorted(missing)}; libraries in it: see `unzip -l {wheel}`")
    return sorted(kept)


def python_tag() -> str:
    """The CPython tag of this interpreter (``cp311``): the one the fetched wheels are for."""
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def wheel_python_tags(names) -> set[str]:
    """The interpreter-specific tags (``cp311``) in wheel file names: those of wheels built for one
    CPython's ABI (``cp311-cp311``); pure (``py3-none``) and stable-ABI (``cp38-abi3``) wheels add
    none. (``check.sh`` applies the same rule on the device.)"""
    out: set[str] = set()
    for name in names:
        parts = Path(name).name[:-len(".whl")].split("-")
        if len(parts) >= 5 and parts[-2].startswith("cp"):
            out |= {t for t in parts[-3].split(".") if t.startswith("cp")}
    return out


class OverLimit(Exception):
    """The staged wheels are over the size limit (the destination was left untouched)."""


def place(staged: Path, manifest: list[dict], dest: Path, max_bytes: float) -> int:
    """Measure the staged wheels; only when their total is within ``max_bytes`` replace the
    ``*.whl`` files of ``dest`` with them (filling each entry's ``bytes`` and ``sha256``) and
    return the total. Over the limit: raise ``OverLimit`` before touching ``dest``."""
    for entry in manifest:
        path = staged / entry["file"]
        entry["bytes"] = path.stat().st_size
        entry["sha256"] = sha256(path)
    total = sum(e["bytes"] for e in manifest)
    if total > max_bytes:
        raise OverLimit(f"the wheels take {total / MIB:.2f} MiB, over the {max_bytes / MIB:g} MiB limit; "
                        f"{dest} was left as it was (trim bitsandbytes with --bnb-keep, or ship fewer wheels)")
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    for entry in manifest:
        shutil.move(str(staged / entry["file"]), dest / entry["file"])
    return total


def write_manifest(dest: Path, manifest: list[dict], total: int) -> None:
    (dest / "MANIFEST.json").write_text(json.dumps(
        {"python": f"{sys.version_info.major}.{sys.version_info.minor}", "python_tag": python_tag(),
         "platform": sysconfig.get_platform(), "device_has": list(DEVICE_HAS), "total_bytes": total,
         "wheels": manifest}, indent=1) + "\n")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    ap.add_argument("--bnb-keep", default=BNB_KEEP_DEFAULT,
                    help="CUDA libraries of bitsandbytes to keep besides the CPU one (comma-separated)")
    ap.add_argument("--max-mib", type=float, default=60.0)
    ap.add_argument("--list", action="store_true", help="print what would be fetched and stop")
    args = ap.parse_args()

    todo = wanted()
    print(f"python {sys.version.split()[0]} ({python_tag()}, {sysconfig.get_platform()}): the wheels are for "
          f"this CPython; the device lacks {len(todo)} distributions:")
    for name, version in todo.items():
        print(f"  {name}=={version}")
    if args.list:
        return 0
    keep = [k.strip() for k in args.bnb_keep.split(",") if k.strip()]
    manifest = []
    with tempfile.TemporaryDirectory(prefix="lazytrain-wheels-") as t:
        tmp = Path(t)
        staged = tmp / "out"
        staged.mkdir()
        for name, version in todo.items():
            wheel, how = fetch_one(name, version, tmp)
            entry = {"name": name, "version": version, "file": wheel.name, "source": how}
            if name == "bitsandbytes":
                entry["original_bytes"] = wheel.stat().st_size
                entry["libraries"] = repack_bitsandbytes(wheel, keep, staged / wheel.name)
                entry["source"] = f"{how}, repacked (kept {', '.join(entry['libraries'])})"
            else:
                shutil.copy2(wheel, staged / wheel.name)
            manifest.append(entry)
        other = wheel_python_tags(e["file"] for e in manifest) - {python_tag()}
        if other:
            raise SystemExit(f"wheels for {sorted(other)} among those fetched for {python_tag()}: {manifest}")
        try:
            total = place(staged, manifest, args.dest, args.max_mib * MIB)
        except OverLimit as err:
            for e in manifest:
                print(f"{e['file']:<78} {e['bytes'] / MIB:7.2f}  {e['source']}")
            print(f"ERROR: {err}", file=sys.stderr)
            return 1
    write_manifest(args.dest, manifest, total)
    print(f"\n{'wheel':<78} {'MiB':>7}")
    for e in manifest:
        print(f"{e['file']:<78} {e['bytes'] / MIB:7.2f}  {e['source']}")
    print(f"total {total / MIB:.2f} MiB in {len(manifest)} wheels for {python_tag()} -> {args.dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
