"""lightning-lazytrain: train models larger than GPU memory from PyTorch Lightning.

Importing the package registers the strategies ``"lazytrain"`` and ``"lazytrain_megatrain"`` with
Lightning's Trainer and Fabric (``lightning_lazytrain.strategy``, ``lightning_lazytrain.fabric_strategy``)
without importing torch or Lightning itself: the planner (``lightning_lazytrain.planner``) and the
``lazytrain-plan`` app need neither, and Lightning takes seconds to import.

How: Lightning's strategy registries exist only once ``lightning`` is imported, and every import of
``lightning.pytorch`` or ``lightning.fabric`` runs ``lightning/__init__.py``, which imports both. So

* if ``lightning`` is already imported, the strategies are registered now;
* otherwise a finder on ``sys.meta_path`` waits for ``import lightning`` and registers them as soon as that
  module has finished executing (before the ``import`` statement that triggered it returns), then removes
  itself. ``Trainer(strategy="lazytrain")`` and ``Fabric(strategy="lazytrain")`` therefore always find the
  names, whichever of the two packages is imported first.

Without Lightning installed (planner-only installs) nothing is registered.
"""

import sys

__version__ = "0.1.0"


def _register() -> None:
    """Import the two strategy modules; each registers its names on import."""
    from lightning_lazytrain import strategy  # noqa: F401  (Trainer(strategy="lazytrain"))
    from lightning_lazytrain import fabric_strategy  # noqa: F401  (Fabric(strategy="lazytrain"))


def _register_after_lightning() -> None:
    try:
        _register()
    except Exception as err:  # noqa: BLE001 - never break `import lightning` itself
        import warnings

        warnings.warn(f"lightning_lazytrain: could not register the 'lazytrain' strategies with Lightning: "
                      f"{type(err).__name__}: {err}", RuntimeWarning, stacklevel=3)


class _RegisteringLoader:
    """Wraps the loader of ``lightning``: runs it, then registers the strategies."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def __getattr__(self, name):  # anything else a loader offers
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self._loader  # leave no trace of the wrapper on the module
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        try:
            self._loader.exec_module(module)
        finally:
            _remove_hook()
        _register_after_lightning()


class _LightningImportHook:
    """A ``sys.meta_path`` finder that only answers for ``lightning``: it asks the other finders for the spec
    and wraps its loader in ``_RegisteringLoader``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "lightning":
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module") \
                        and not isinstance(spec.loader, _RegisteringLoader):
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


def _remove_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _LightningImportHook)]


def _install() -> None:
    if "lightning" in sys.modules:
        _register()
    elif not any(isinstance(f, _LightningImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _LightningImportHook())


_install()
