"""Fetch the wheels a lent GPU machine lacks, once, on a development machine with pip access.

    python bench/device/fetch_wheels.py                   # for the device's Python 3.12 -> bench/device/wheels/
    python bench/device/fetch_wheels.py --python 3.13     # for another device Python
    python bench/device/fetch_wheels.py --python current  # for this interpreter's version (a CPU rehearsal here)

The GPU machine's image (Python 3.12.3, torch 2.11.0+cu130, lightning 2.6.6, transformers 5.17.0)
has torch, lightning, transformers, pytest, hypothesis and matplotlib (and what they pull in); it has
no network. This script ships the rest of what the project declares (``pyproject.toml``: its
dependencies and the ``train``, ``test`` and ``hf`` extras), with every dependency of those that the
image does not already hold, at the exact versions installed *here*, for the *device's* Python
(``--python``, default 3.12), whatever Python runs this script:

  1. the closure of the project's requirements over the installed distributions' metadata, minus
     the closure of what the image has (``DEVICE_HAS``), with environment markers evaluated for the
     target (its Python version, CPython on Linux x86_64);
  2. each one as ``pip download --only-binary=:all: --no-deps --python-version 3.12
     --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 ... --platform
     manylinux2014_x86_64 name==version``: a wheel for CPython 3.12 (``cp312``, the stable ABI
     ``abi3`` or pure ``py3-none-any``) on manylinux x86_64 up to glibc ``--glibc`` (2.28: the
     image runs torch's ``manylinux_2_28`` wheels, so its glibc is at least that);
     a distribution published only as an sdist (antlr4-python3-runtime 4.9.3) is built here with
     ``pip wheel --no-deps`` and must come out pure Python (``py3-none-any``, any Python 3);
  3. the kit's own extras (``KIT_EXTRAS``: DeepSpeed, for the ``fit`` stage's ZeRO-3 offload peer)
     with their dependencies, when installed here (``pip install deepspeed==0.19.8``); otherwise left
     out with a warning (that variant then records ``skipped``), and ``MANIFEST.json`` says so
     (``left_out``). PyPI has DeepSpeed as an sdist only: built here (``DS_BUILD_OPS=0``, no torch in
     the build's isolated environment) into a pure ``py3-none-any`` wheel without prebuilt ops, whose
     CPU Adam is JIT-built on the device with the image's compiler;
  4. bitsandbytes is repacked: its wheel carries a native library for every CUDA/ROCm/XPU release
     (43 MB compressed). Kept: ``libbitsandbytes_cpu.so`` and the CUDA libraries named by
     ``--bnb-keep`` (default ``cuda128,cuda130``: the newest 12.x and the first 13.x; bitsandbytes
     loads the closest library of the runtime's major version, see its ``cextension.py``); every
     other ``libbitsandbytes_*.so`` is dropped and its line removed from ``RECORD``. The file keeps
     its name; ``MANIFEST.json`` records the repack and the libraries kept.

The folder must stay below ``--max-mib`` (60 MiB): the copy of the working tree sent to the GPU
machine takes at most 64 MiB of git-ignored files. The wheels are downloaded into a temporary
folder and measured there; only a set under the limit replaces the folder's wheels (an oversized
set leaves the folder as it was and exits 1). ``MANIFEST.json`` lists every wheel with its size
and sha256, and the interpreter the set was fetched for: ``python`` (``3.12``), ``python_tag``
(``cp312``: compiled wheels such as highspy's only fit that CPython) and ``platforms`` (the
manylinux tags accepted), with ``fetched_with`` (the Python that ran this script). ``check.sh``
refuses (exit 2, with the fix) to install a set whose ``python_tag`` differs from the device's
interpreter, or whose compiled wheels are for another machine, and installs exactly the ``*.whl``
files of the folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
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
#: What the kit's own stages use beyond the project's requirements: DeepSpeed (the ``fit`` stage's
#: ``deepspeed_stage_3_offload`` peer). Shipped, with its dependencies, when installed here.
KIT_EXTRAS = ("deepspeed",)
#: The DeepSpeed the kit was written against (PyPI: sdist only, built here into a pure wheel).
DEEPSPEED_VERSION = "0.19.8"
#: Dependencies of ``KIT_EXTRAS`` shipped even though the image's closure, as computed here, holds them:
#: here transformers 5.25 pulls pydantic in (through typer), the image's transformers 5.17 (through
#: typer-slim) does not, and DeepSpeed cannot import without it. Shipped with their own dependencies
#: less torch's.
EXTRAS_SHIP_ANYWAY = ("pydantic",)
#: Environment of sdist builds: DeepSpeed without prebuilt ops (its ops are JIT-built on the device).
BUILD_ENV = {"DS_BUILD_OPS": "0"}
BNB_KEEP_DEFAULT = "cuda128,cuda130"
MIB = 1 << 20
#: The device's Python (its image: Python 3.12.3); ``--python`` names another, ``current`` this one.
DEFAULT_PYTHON = "3.12"
#: The newest glibc the wheels may need (``manylinux_2_28``: the image's torch wheels need that much).
DEFAULT_GLIBC = "2.28"
MACHINE = "x86_64"


@dataclass(frozen=True)
class Target:
    """The interpreter the wheels are for: CPython ``version`` (``3.12`` or ``3.12.3``) on manylinux
    ``MACHINE`` with glibc up to ``glibc``."""

    version: str = DEFAULT_PYTHON
    glibc: str = DEFAULT_GLIBC

    @property
    def major_minor(self) -> tuple[int, int]:
        major, minor = self.version.split(".")[:2]
        return int(major), int(minor)

    @property
    def short(self) -> str:
        return "%d.%d" % self.major_minor

    @property
    def tag(self) -> str:
        return "cp%d%d" % self.major_minor

    def platforms(self) -> list[str]:
        """manylinux tags from ``glibc`` down to 2.17; ``manylinux2014`` (which pip expands to the
        older ``manylinux2010``/``manylinux1`` tags) last."""
        major, top = (int(x) for x in self.glibc.split("."))
        return [f"manylinux_{major}_{m}_{MACHINE}" for m in range(top, 16, -1)] + [f"manylinux2014_{MACHINE}"]

    def compatible_platforms(self) -> set[str]:
        """Every platform tag pip accepts for ``platforms()`` (it expands ``manylinux2014`` to the
        older tags)."""
        return set(self.platforms()) | {f"manylinux{t}_{MACHINE}" for t in ("2010", "1", "_2_12", "_2_5")}

    def markers(self) -> dict[str, str]:
        """PEP 508 marker variables of the target (CPython on Linux ``MACHINE``)."""
        full = self.version if self.version.count(".") == 2 else f"{self.short}.0"
        return {"python_version": self.short, "python_full_version": full, "implementation_name": "cpython",
                "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
                "platform_machine": MACHINE, "os_name": "posix"}

    def pip_args(self) -> list[str]:
        """pip's flags that select this target's wheels (``pip download`` only)."""
        args = ["--only-binary=:all:", "--python-version", self.version, "--implementation", "cp", "--abi", self.tag]
        for plat in self.platforms():
            args += ["--platform", plat]
        return args


def parse_python(text: str) -> Target:
    """``--python``: ``3.12`` / ``3.12.3``, or ``current`` (this interpreter's ``major.minor``)."""
    if text == "current":
        return Target(f"{sys.version_info.major}.{sys.version_info.minor}")
    parts = text.split(".")
    if not (2 <= len(parts) <= 3 and all(p.isdigit() for p in parts) and parts[0] == "3"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a CPython 3 version such as 3.12 or 3.12.3 (or "
                                         "'current', this interpreter's)")
    return Target(text)


def project_requirements() -> list[Requirement]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = data["project"]
    reqs = [Requirement(r) for r in project.get("dependencies", [])]
    for extra in EXTRAS:
        reqs += [Requirement(r) for r in project.get("optional-dependencies", {}).get(extra, [])]
    return reqs


def _applies(req: Requirement, extras: set[str], target: Target) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**target.markers(), "extra": e}) for e in (extras or {""}))


def closure(roots: list[Requirement], target: Target | None = None) -> dict[str, str]:
    """{canonical name: installed version} of ``roots`` and everything they require on ``target``
    (default: the device's Python), read from the metadata of the distributions installed here."""
    target = target or Target()
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
            raise SystemExit(f"{name} is required on Python {target.version} but not installed here (Python "
                             f"{sys.version.split()[0]}), so its version is unknown; install the project first "
                             f"(pip install -e '.[{','.join(EXTRAS)}]'), and install {name} here if only the "
                             "target Python needs it") from None
        seen[key] = dist.version
        extras_seen.setdefault(key, set()).update(extras)
        for spec in dist.requires or []:
            req = Requirement(spec)
            if _applies(req, extras, target):
                todo.append((req.name, set(req.extras)))
    return seen


def kit_extras() -> tuple[list[Requirement], list[str]]:
    """(the ``KIT_EXTRAS`` installed here, as requirements; why each other one is left out)."""
    present, left_out = [], []
    for name in KIT_EXTRAS:
        try:
            metadata.distribution(name)
            present.append(Requirement(name))
        except metadata.PackageNotFoundError:
            pin = f"=={DEEPSPEED_VERSION}" if name == "deepspeed" else ""
            left_out.append(f"{name}: not installed here (pip install {name}{pin}, then fetch again)")
    return present, left_out


def wanted(target: Target | None = None, extras: bool = True) -> dict[str, str]:
    """{name: version} to ship for ``target`` (default: the device's Python): the project's requirements
    and, with ``extras``, the ``KIT_EXTRAS`` installed here, with their dependencies, less the image's."""
    target = target or Target()
    present = kit_extras()[0] if extras else []
    ship = closure(project_requirements() + present, target)
    has = closure([Requirement(n) for n in DEVICE_HAS], target)
    if present:
        anyway = closure([Requirement(n) for n in EXTRAS_SHIP_ANYWAY], target)
        has = set(has) - (set(anyway) - set(closure([Requirement("torch")], target)))
    return {k: v for k, v in sorted(ship.items()) if k not in has and k != canonicalize_name("lightning-lazytrain")}


def pip(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          env={**os.environ, **env} if env else None)


def fetch_one(name: str, version: str, tmp: Path, target: Target | None = None) -> tuple[Path, str]:
    target = target or Target()
    out = tmp / canonicalize_name(name)
    out.mkdir()
    r = pip("download", *target.pip_args(), "--no-deps", "-d", str(out), f"{name}=={version}")
    how = "wheel"
    if r.returncode != 0 and "No matching distribution" not in r.stderr + r.stdout:
        raise SystemExit(f"pip download {name}=={version} for {target.tag} failed:\n{r.stdout}\n{r.stderr}")
    if r.returncode != 0:
        # no wheel for the target (sdist only): build it here; it must be pure Python to install on the device.
        r = pip("wheel", "--no-deps", "--no-binary", name, "-w", str(out), f"{name}=={version}", env=BUILD_ENV)
        how = "built from sdist"
        if r.returncode != 0:
            raise SystemExit(f"could not get {name}=={version} for {target.tag} (no wheel for it, and building "
                             f"one here failed):\n{r.stdout}\n{r.stderr}")
    wheels = list(out.glob("*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"{name}=={version}: expected one wheel, got {[w.name for w in wheels]}")
    if how != "wheel" and not wheels[0].name.endswith("-none-any.whl"):
        raise SystemExit(f"{wheels[0].name} was built from an sdist but is not pure Python (it would fit this "
                         f"Python only, not {target.tag})")
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
    """The CPython tag of this interpreter (``cp311``)."""
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def wheel_platforms(names) -> set[str]:
    """The platform tags in wheel file names (``any``, ``manylinux_2_17_x86_64``...)."""
    out: set[str] = set()
    for name in names:
        parts = Path(name).name[:-len(".whl")].split("-")
        if len(parts) >= 5:
            out |= set(parts[-1].split("."))
    return out


def foreign_wheels(names, target: Target) -> list[str]:
    """The wheels in ``names`` that do not install on ``target``: built for another CPython's ABI,
    or for a platform that is neither ``any`` nor one of the target's manylinux tags."""
    ok = target.compatible_platforms() | {"any"}
    return [Path(name).name for name in names
            if wheel_python_tags([name]) - {target.tag} or not wheel_platforms([name]) & ok]


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


def write_manifest(dest: Path, manifest: list[dict], total: int, target: Target | None = None,
                   left_out: list[str] | None = None) -> None:
    target = target or Target()
    (dest / "MANIFEST.json").write_text(json.dumps(
        {"python": target.short, "python_tag": target.tag, "platforms": target.platforms(),
         "fetched_with": sys.version.split()[0], "device_has": list(DEVICE_HAS), "total_bytes": total,
         "kit_extras": list(KIT_EXTRAS), "left_out": list(left_out or []), "wheels": manifest}, indent=1) + "\n")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", type=parse_python, default=parse_python(DEFAULT_PYTHON), metavar="X.Y",
                    help=f"the CPython the wheels are for (default {DEFAULT_PYTHON}, the device's; 'current': "
                         "this interpreter's version, for a CPU rehearsal here)")
    ap.add_argument("--glibc", default=DEFAULT_GLIBC,
                    help=f"newest manylinux glibc the wheels may need (default {DEFAULT_GLIBC})")
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    ap.add_argument("--bnb-keep", default=BNB_KEEP_DEFAULT,
                    help="CUDA libraries of bitsandbytes to keep besides the CPU one (comma-separated)")
    ap.add_argument("--max-mib", type=float, default=60.0)
    ap.add_argument("--list", action="store_true", help="print what would be fetched and stop")
    ap.add_argument("--no-kit-extras", action="store_true",
                    help=f"leave out {', '.join(KIT_EXTRAS)} (the fit stage's DeepSpeed peer then records skipped)")
    args = ap.parse_args()
    if not (args.glibc.count(".") == 1 and all(p.isdigit() for p in args.glibc.split("."))
            and int(args.glibc.split(".")[0]) == 2 and int(args.glibc.split(".")[1]) >= 17):
        ap.error(f"--glibc {args.glibc!r}: give a glibc version such as 2.28 (2.17 or newer)")
    target = Target(args.python.version, args.glibc)

    left_out = [f"{n}: --no-kit-extras" for n in KIT_EXTRAS] if args.no_kit_extras else kit_extras()[1]
    todo = wanted(target, extras=not args.no_kit_extras)
    for why in left_out:
        print(f"warning: left out {why}; the fit stage's DeepSpeed peer will record skipped", file=sys.stderr)
    print(f"wheels for CPython {target.version} ({target.tag}, {target.platforms()[0]} and older manylinux tags), "
          f"fetched with Python {sys.version.split()[0]}; the device lacks {len(todo)} distributions:")
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
            wheel, how = fetch_one(name, version, tmp, target)
            entry = {"name": name, "version": version, "file": wheel.name, "source": how}
            if name == "bitsandbytes":
                entry["original_bytes"] = wheel.stat().st_size
                entry["libraries"] = repack_bitsandbytes(wheel, keep, staged / wheel.name)
                entry["source"] = f"{how}, repacked (kept {', '.join(entry['libraries'])})"
            else:
                shutil.copy2(wheel, staged / wheel.name)
            manifest.append(entry)
        foreign = foreign_wheels([e["file"] for e in manifest], target)
        if foreign:
            raise SystemExit(f"wheels that do not fit {target.tag} on manylinux {MACHINE}: {foreign}")
        try:
            total = place(staged, manifest, args.dest, args.max_mib * MIB)
        except OverLimit as err:
            for e in manifest:
                print(f"{e['file']:<78} {e['bytes'] / MIB:7.2f}  {e['source']}")
            print(f"ERROR: {err}", file=sys.stderr)
            return 1
    write_manifest(args.dest, manifest, total, target, left_out)
    print(f"\n{'wheel':<78} {'MiB':>7}")
    for e in manifest:
        print(f"{e['file']:<78} {e['bytes'] / MIB:7.2f}  {e['source']}")
    print(f"total {total / MIB:.2f} MiB in {len(manifest)} wheels for {target.tag} -> {args.dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
