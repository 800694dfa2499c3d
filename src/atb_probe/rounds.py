"""What the capture side needs from the rest of the probe: a source of rounds.

The call tree (`capture/calltree.py`) sees the probe only through `RoundSource`: at a root call
it asks for a `RoundStart` (the round's index, the selection it runs under, the process's
`<dev>_<pid>` name, and whether it is dumped), it says when a dumped round is over (and whether it
wrote anything), and it
hands over the errors it caught. Everything it writes goes to a sink, the background
`record.writer.Writer`. Neither side knows the other's other parts (config watching, the status
file, process hooks). Pure; no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .enums import StrEnum
from .selection import Selection


class Phase(StrEnum):
    """A round's phase (SPEC §5, model file names): the first call of a generation
    (`Prefill`, no KV cache yet), a later one (`Decoder`), or a model without a cache
    argument (`Forward`). Its text is its value, in files and messages alike."""

    PREFILL = "Prefill"
    DECODER = "Decoder"
    FORWARD = "Forward"


@dataclass(frozen=True, slots=True)
class RoundStart:
    """A round as the probe starts it."""

    index: int                      # 0, 1, 2... root calls in this process
    selection: Selection | None     # the configuration it runs under (None: none yet)
    devpid: str                     # `<dev>_<pid>`: where its files go
    dumping: bool                   # exec_range and device select it, and the writer works


class RoundSource(Protocol):
    """The probe, as the call tree sees it."""

    def start_round(self, module, args: tuple, kwargs: dict) -> RoundStart:
        """A root call begins: number it and decide whether it is dumped."""

    def round_dumped(self, wrote: bool) -> None:
        """A dumped round has ended; `wrote`: whether it wrote any data."""

    def next_round_dumped(self) -> bool:
        """Whether the next round this thread starts would be dumped (nothing is numbered)."""

    def report(self, exc: BaseException) -> None:
        """A probe error the call tree caught: reported once; the model goes on."""
