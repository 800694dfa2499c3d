"""atb-probe: operator-level precision dumps of PyTorch models in the msProbe ATB layout.

Most users never import this: sourcing `load_atb_probe.sh` makes every Python process load the
probe when it imports torch. For notebooks and tests::

    import atb_probe
    with atb_probe.enabled(output="out", config="config.json"):   # or config={...}
        model(...)
    # the block's end flushes everything to disk, as atb_probe.disable() does

`enable` / `disable` do the same for code that cannot wrap the model's calls in a block.

`atb_probe.step()` marks one inference step of a serving loop (several root modules called in
turn) as one round. `atb_probe.load(path)` reads one `.bin` file back as a torch tensor;
`atb_probe.open_dump(path)` walks a whole dump.
"""
from __future__ import annotations

import contextlib
import os

__version__ = "0.1.0"
__all__ = ["enable", "disable", "enabled", "active", "step", "load", "open_dump",
           "__version__"]

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


@contextlib.contextmanager
def enabled(output: str = ".", config=None, timeout: float | None = None):
    """`enable` for the length of a `with` block, which gets the `Probe`: however the block
    ends, the probe is closed as `disable(timeout)` closes it (queued data on disk, the final
    status written), and the hooks it installed are taken out."""
    probe = enable(output, config)
    try:
        yield probe
    finally:
        if _probe is probe:
            disable(timeout)
        else:  # the block enabled another probe meanwhile: that one is not ours to close
            probe.close(timeout)


def active():
    """The running `Probe`, or None."""
    return _probe


class step(contextlib.ContextDecorator):
    """One engine step: every root module called in this thread until it ends makes one round
    (one folder, one statistic.csv, layer-level IDs continuing from one root to the next).
    A context manager and a decorator; `phase` ("Prefill" or "Decoder") names the step's phase
    where no cache argument tells it. Nothing happens while no probe runs::

        with atb_probe.step():
            hidden = model(ids)
            logits = head(hidden)
            token = sampler(logits)
    """

    def __init__(self, phase: str | None = None):
        from .rounds import Phase
        if phase not in (None, Phase.PREFILL, Phase.DECODER):
            raise ValueError(f'phase must be "Prefill", "Decoder" or None, not {phase!r}')
        self.phase = None if phase is None else Phase(phase)
        self._engine = None

    def _recreate_cm(self):
        return type(self)(self.phase)  # as a decorator: one per call, whatever the thread

    def __enter__(self):
        self._engine = getattr(_probe, "engine", None)
        if self._engine is not None:
            self._engine.steps.begin(self.phase)
        return self

    def __exit__(self, *exc):
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.steps.end()
        return False


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
