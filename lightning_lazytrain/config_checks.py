"""The config apps' checks of what the user wrote: keys the schema does not know (with the nearest ones), Hydra's
composition errors in one line, the command line checked before Hydra runs, and the ``--help`` group listing."""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
import re
from typing import Any, Dict, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from .config import CONF_DIR
from .planner.errors import PlannerError

# ---- the schema's refusals, as the user wrote the keys --------------------------------------------------------
class ConfigKeyError(PlannerError):
    """A key the app's typed schema does not have: misspelt, added with ``+`` / ``++``, or renamed. ``key`` is the
    dotted key as written."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(message)


#: keys that were renamed: old dotted key -> (new dotted key, what it means)
RENAMED_KEYS: Dict[str, tuple[str, str]] = {
    "data.val_every": ("data.holdout_every", "every n-th file of the text is held out for validation; how often "
                                             "validation runs is trainer.val_check_interval"),
}


def _fields(schema: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []


def unknown_key_message(key: str, schema: Any = None) -> str:
    """One line for a key the schema does not have: the renamed key's new name, or the closest known key."""
    if key in RENAMED_KEYS:
        new, meaning = RENAMED_KEYS[key]
        return f"{key} was renamed {new} ({meaning}): write {new}=..."
    parent, _, leaf = key.rpartition(".")
    known = _fields(schema)
    where = f"{parent} ({schema.__name__})" if parent and known else parent or "the top level"
    text = f"unknown key {key}: {where} has no key {leaf!r}, and the schema refuses keys it does not know (a + " \
           "prefix does not add one)"
    close = [k for k in known if k.startswith(leaf) or leaf.startswith(k)] or \
        difflib.get_close_matches(leaf, known, n=1, cutoff=0.6)
    if close:
        text += f"; did you mean {parent + '.' if parent else ''}{close[0]}?"
    elif known:
        text += f"; its keys: {', '.join(known)}"
    return text


def unknown_keys(cfg: Any) -> list[tuple[str, Any]]:
    """Every key of a composed config that its typed schema does not have, as ``(dotted key, schema dataclass)``.

    Hydra refuses ``trainer.max_stepz=3`` at composition, but ``+trainer.max_stepz=3`` (Hydra's own hint) and
    ``++...`` add the key to the typed node; this finds those. Nodes typed ``Dict[...]`` or ``Any`` take any key."""
    found: list[tuple[str, Any]] = []

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, DictConfig) or node._is_none() or node._is_missing() or node._is_interpolation():
            return
        schema = OmegaConf.get_type(node)
        names = set(_fields(schema))
        for key in node.keys():
            path = f"{prefix}{key}"
            if names and key not in names:
                found.append((path, schema))
                continue
            walk(node._get_node(key), path + ".")

    walk(cfg, "")
    return found


def check_schema(cfg: Any) -> None:
    """Raise ``ConfigKeyError`` (one line, the keys as written) if the composed ``cfg`` has keys its schema does not
    have (see ``unknown_keys``)."""
    bad = unknown_keys(cfg) if isinstance(cfg, DictConfig) else []
    if bad:
        (key, schema), rest = bad[0], bad[1:]
        text = unknown_key_message(key, schema)
        if rest:
            text += f" (and {len(rest)} more unknown: {', '.join(k for k, _ in rest)})"
        raise ConfigKeyError(key, text)


def _first_line(text: str) -> str:
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def composition_error_message(err: BaseException, groups: Sequence[str] = ()) -> str:
    """Hydra's composition error (``ConfigCompositionException``, ``MissingConfigException``, an override that does not
    parse) as one line naming the key as written; ``groups``: the app's config groups (named when the user picks one
    it does not have)."""
    from omegaconf.errors import ConfigAttributeError, OmegaConfBaseException

    cause = err.__cause__
    text = str(err)
    full_key = getattr(cause, "full_key", None)
    if isinstance(cause, ConfigAttributeError) and full_key and " not in " in str(cause):
        return unknown_key_message(str(full_key), getattr(cause, "object_type", None))
    if isinstance(cause, OmegaConfBaseException) and full_key:
        return f"{full_key}: {_first_line(str(cause))}"
    m = re.search(r"Could not override '([^']+)'\. No match in the defaults list", text)
    if m:
        choice = f" (its groups: {', '.join(groups)})" if groups else ""
        return f"{m.group(1)}=...: this app has no config group {m.group(1)!r}{choice}"
    m = re.search(r"Could not find '([^'/]+)/([^']+)'", text)
    if m:
        options = re.search(r"Available options in '[^']+':\n((?:\t.*\n?)*)", text)
        known = ", ".join(o.strip() for o in options.group(1).splitlines() if o.strip()) if options else ""
        return f"{m.group(1)}={m.group(2)}: no such option in config group {m.group(1)}" + \
            (f"; available: {known}" if known else "")
    lines = [line.strip() for line in text.split("Config search path")[0].splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith(("To append to your", "See https://hydra.cc"))]
    return " ".join(lines) or type(err).__name__


def _hydra_override_key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def _job_overrides(overrides: Sequence[str], multirun: bool, limit: int = 64) -> list[list[str]]:
    """The override lists of the jobs a command line runs (one in a single run; a multirun's sweeps expanded, all
    combinations up to ``limit``, else each swept value once). Hydra's own overrides (``hydra.*``, ``hydra/...``)
    are left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    mine = [o for o in overrides if not _hydra_override_key(o).startswith("hydra")]
    parsed = OverridesParser.create().parse_overrides(mine)  # raises on an override that does not parse
    if not multirun:
        return [mine]
    choices: list[list[str]] = []
    for text, o in zip(mine, parsed):
        if o.is_sweep_override() and o.is_discrete_sweep():
            choices.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] or [text])
        elif o.is_sweep_override():  # a range/interval for another sweeper: checked at its first value by Hydra
            continue
        else:
            choices.append([text])
    if math.prod(len(c) for c in choices) <= limit:
        return [list(combo) for combo in itertools.product(*choices)]
    jobs = []
    for i, options in enumerate(choices):
        for value in options:
            jobs.append([value if j == i else c[0] for j, c in enumerate(choices)])
    return jobs


def check_command_line(config_name: str, argv: Sequence[str], groups: Sequence[str] = ()) -> Optional[str]:
    """Compose the app's config from the command line ``argv`` (without the program name) as Hydra will, before
    Hydra creates an output directory, and check it against the typed schema: None if it composes (or the command
    line asks Hydra for something else: ``--help``, ``--cfg``, another config directory...), else one line naming
    the key as written: a misspelt or ``+``-added key, a renamed key, a value of the wrong type, an unknown group
    option. Each job of a multirun is composed (its sweeps expanded)."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser
    from hydra.core.global_hydra import GlobalHydra

    try:
        args = get_args_parser().parse_args(list(argv))
    except SystemExit:  # argparse's own error: Hydra reports it
        return None
    if (args.help or args.hydra_help or args.cfg or args.info or args.shell_completion or args.config_path
            or args.config_name or args.config_dir or getattr(args, "experimental_rerun", None)
            or any(_hydra_override_key(o).startswith("hydra.searchpath") for o in args.overrides)):
        return None  # Hydra's business, or configs from elsewhere: Hydra composes (and the jobs check the schema)
    try:
        jobs = _job_overrides(args.overrides, bool(args.multirun))
    except Exception as err:  # noqa: BLE001 - an override that does not parse: name it
        from hydra.core.override_parser.overrides_parser import OverridesParser

        for override in args.overrides:
            try:
                OverridesParser.create().parse_overrides([override])
            except Exception as bad:  # noqa: BLE001
                return f"cannot parse the override {override!r}: {_first_line(str(bad))}"
        return composition_error_message(err, groups)
    gh = GlobalHydra.instance()
    previous = gh.hydra if gh.is_initialized() else None  # e.g. a caller's own compose session: put back after
    gh.clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            for overrides in jobs:
                try:
                    cfg = compose(config_name=config_name, overrides=overrides)
                except Exception as err:  # noqa: BLE001 - Hydra's composition errors, reported in one line
                    return composition_error_message(err, groups)
                try:
                    check_schema(cfg)
                except ConfigKeyError as err:
                    return str(err)
    finally:
        gh = GlobalHydra.instance()  # initialize_config_dir puts back a copy of the singleton, not the object
        gh.clear()
        if previous is not None:
            gh.initialize(previous)
    return None


# ---- help -------------------------------------------------------------------------------------------------------
def config_groups_help(*groups: str) -> str:
    """``group: option, option`` lines for the app's own config groups (the ``--help`` template's
    ``${lazytrain_groups:...}``; Hydra's ``$APP_CONFIG_GROUPS`` lists every directory in ``conf/``, also the other
    app's groups)."""
    lines = []
    for group in groups:
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        lines.append(f"{group}: {', '.join(options)}")
    return "\n".join(lines)


OmegaConf.register_new_resolver("lazytrain_groups", config_groups_help, replace=True)
