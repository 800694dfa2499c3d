"""atb-probe bootstrap, found first on PYTHONPATH after `source load_atb_probe.sh`.

It runs at interpreter start-up and does almost nothing: it chains to the `sitecustomize` this
one shadows, and arranges for the probe to attach right after the program imports `torch`
(a process that never imports torch pays only this file). Nothing here may raise.
"""
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain_to_shadowed() -> None:
    path = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _attach() -> None:
    try:
        try:
            import atb_probe
        except ImportError:
            package = os.path.dirname(_HERE)
            spec = importlib.util.spec_from_file_location(
                "atb_probe", os.path.join(package, "__init__.py"),
                submodule_search_locations=[package])
            atb_probe = importlib.util.module_from_spec(spec)
            sys.modules["atb_probe"] = atb_probe
            spec.loader.exec_module(atb_probe)
        atb_probe._attach_from_env()
    except Exception as exc:
        sys.stderr.write(f"[atb-probe] ERROR: could not attach: {type(exc).__name__}: {exc}\n")


class _AfterTorchImport:
    """A meta-path finder that runs `_attach` once `import torch` has finished."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_attach(module):
            exec_module(module)
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass
            _attach()

        try:
            loader.exec_module = exec_then_attach
        except Exception:
            return spec
        return spec

    def invalidate_caches(self):
        pass


def _install() -> None:
    if not os.environ.get("ATB_DUMP_CONFIG"):
        return
    if "torch" in sys.modules:
        _attach()
    else:
        sys.meta_path.insert(0, _AfterTorchImport())


try:
    _chain_to_shadowed()
except Exception as _exc:
    sys.stderr.write(f"[atb-probe] WARNING: the shadowed sitecustomize failed: {_exc}\n")
try:
    _install()
except Exception as _exc:
    sys.stderr.write(f"[atb-probe] ERROR: bootstrap failed: {_exc}\n")
