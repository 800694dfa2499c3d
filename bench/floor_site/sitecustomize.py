"""Bench only: `layer_floor.py`'s recording in every process of a serving engine.

`vllm_offline.py --floor VARIANT` (refs, copies, refs+rows, copies+rows) puts this folder on
PYTHONPATH after the probe's bootstrap, whose `sitecustomize` runs this one, and sets
BENCH_LAYER_FLOOR to the variant. The engine's processes start from that environment, so in
each of them, once `atb_probe.capture.recorder` is imported, `Recorder.write_side` becomes the
variant's (`layer_floor.replaced_write_side`): the worker's module sides keep references or
copies of their tensors and, with rows, hand over their rows with a constant cell. Each process
that installs it says so on stderr. With the variable unset nothing is installed.
"""
import importlib.abc
import importlib.util
import os
import sys
from collections import deque

_BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RECORDER = "atb_probe.capture.recorder"
_KEEP = 4096  # copies kept at once (a decode step of the bench's engine makes about 40)


class _ReplaceWriteSide(importlib.abc.MetaPathFinder):
    """Finds the recorder module as the other finders do, and replaces `write_side` once it
    has run."""

    def __init__(self, variant: str):
        self.variant = variant

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _RECORDER:
            return None
        sys.meta_path.remove(self)  # the module is imported once: the other finders find it
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module
        variant = self.variant

        def exec_module(module):
            run(module)
            if _BENCH not in sys.path:
                sys.path.append(_BENCH)
            import layer_floor
            # The copies live a while, as a design measuring them later would keep them; a
            # bounded deque frees the oldest, so a long run's memory stays flat.
            _, module.Recorder.write_side = layer_floor.replaced_write_side(
                variant, deque(maxlen=_KEEP))
            sys.stderr.write(f"[bench] layer floor {variant} in process {os.getpid()}\n")

        spec.loader.exec_module = exec_module
        return spec


# layer_floor.REPLACED, not imported here: layer_floor imports torch, and the probe's
# bootstrap attaches only once the program itself has imported torch.
_VARIANTS = ("refs", "copies", "refs+rows", "copies+rows")
_variant = os.environ.get("BENCH_LAYER_FLOOR", "")
if _variant in _VARIANTS:
    sys.meta_path.insert(0, _ReplaceWriteSide(_variant))
