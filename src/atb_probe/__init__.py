"""atb-probe: operator-level precision dumps of PyTorch models in the msProbe ATB layout.

Most users never import this: sourcing `load_atb_probe.sh` makes every Python process load the
probe when it imports torch. For notebooks and tests::

    import atb_probe
    atb_probe.enable(output="out", config="config.json")   # or config={...}
    model(...)
    atb_probe.disable()                                     # flushes everything to disk

`atb_probe.load(path)` reads one `.bin` file back as a torch tensor; `atb_probe.open_dump(path)`
walks a whole dump.
"""
from __future__ import annotations

import os

__version__ = "0.1.0"
__all__ = ["enable", "disable", "active", "load", "open_dump", "__version__"]

_probe = None
_suppressed = False  # set by the CLI: our own tools never dump themselves


def enable(output: str = ".", config=None):
    """Start dumping in this process. `config` is a config.json path (watched for changes, like
    the load script's) or a dict / DumpConfig used as is. Returns the `Probe`."""
    global _probe
    from .probe import Probe
    if _probe is not None:
        disable()
    if config is None or isinstance(config, (str, os.PathLike)):
        path = os.fspath(config) if config is not None else os.path.join(
            os.path.dirname(__file__), "scripts", "atb", "config.json")
        probe = Probe(output, config_path=path)
    else:
        probe = Probe(output, config=config)
    probe.start()
    _probe = probe
    return probe


def disable(timeout: float | None = None) -> bool:
    """Stop dumping; wait (at most `timeout` s) until queued data is on disk."""
    global _probe
    probe, _probe = _probe, None
    return probe.close(timeout) if probe is not None else True


def active():
    """The running `Probe`, or None."""
    return _probe


def load(path):
    """A `.bin` file (data, reference or header-only) as a torch tensor."""
    from .binread import load_tensor
    return load_tensor(path)


def open_dump(path):
    """A dump (its root, a `<dev>_<pid>` folder or a round) to walk: processes, rounds, ops,
    tensors with their statistic.csv rows."""
    from .tools.dumpreader import open_dump as _open
    return _open(path)


def _attach_from_env() -> None:
    """Called by the bootstrap once torch is imported: start the probe the shell asked for."""
    if _suppressed or _probe is not None:
        return
    config = os.environ.get("ATB_DUMP_CONFIG")
    if not config:
        return
    try:
        enable(os.environ.get("ATB_OUTPUT_DIR") or os.getcwd(), config)
    except Exception as exc:  # never break the host program
        from . import log
        log.error(f"could not start: {type(exc).__name__}: {exc}")
