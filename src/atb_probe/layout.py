"""The dump tree's layout (SPEC §5): the one place its paths are built and parsed.

::

    <output>/atb_dump_data/                         dump_root(output)
      data/<dev>_<pid>/                             process_dir(devpid)
        <round>/                                    round_dir(devpid, round)
          statistic.csv                             round_csv(round_rel)
          request_statistic.csv                     statcsv.REQUEST_FILE_NAME
          derived_statistic.csv                     statcsv.DERIVED_FILE_NAME
          tokens.json                               TOKENS_JSON
          <id>_<Name>/                              op_folder(own_id, name)
            before/intensor<index>.bin              tensor_file("input", index)
            after/outtensor<index>.bin              tensor_file("output", index)
            op_param.json                           OP_PARAM
            <id>_<ChildName>/...                    the same shape, any depth
      info/layer/<dev>_<pid>[/<Model>]/<Layer>_<id>.json
                                                    layer_info_dir(devpid, model), layer_info_file
      info/model/<dev>_<pid>/<Model>_<Phase>.json   model_info_dir(devpid), model_info_file
      status/<dev>_<pid>.json                       status_file(devpid)

`<dev>_<pid>` is the device ID and the process ID (`devpid`, `parse_devpid`); `<round>` is the
round index in decimal; `<id>` in an op folder is the op's own index among its siblings, so the
folders from the round down to an op spell its full ID and full name (`op_path`). Inputs live in
`before/`, outputs in `after/`; `<index>` is the tensor's position, followed for child modules by
`_<parameter name>` (`intensor0_hidden_states`).

Paths built here are relative to the dump root and use `/`, as the writer's `SafeTree` takes
them; the tools join them to a real root with `os.path.join`. Only `is_round_dir`,
`round_dir_of` and `dump_root` look at the file system. This module imports neither torch nor
anything that does.
"""
from __future__ import annotations

import os
import re

from .enums import StrEnum
from .statcsv import FILE_NAME as CSV_FILE

DUMP_DIR = "atb_dump_data"
DATA_DIR = "data"
INFO_DIR = "info"
STATUS_DIR = "status"
OP_PARAM = "op_param.json"
TOKENS_JSON = "tokens.json"  # a round's token layout (tokens.py)
INFO_KINDS = ("layer", "model")


class Side(StrEnum):
    """The side of an op a tensor is on: the two values of statistic.csv's Input/Output column,
    which the functions below take as `io`."""

    INPUT = "input"
    OUTPUT = "output"


# The same two words as plain str: the recorder's side records hold these, because a tuple of
# str (and bytearray cells) is one the garbage collector stops tracking, an enum member is not.
INPUT, OUTPUT = Side.INPUT.value, Side.OUTPUT.value
_SIDE_DIR = {INPUT: "before", OUTPUT: "after"}
_FILE_PREFIX = {INPUT: "intensor", OUTPUT: "outtensor"}
_IO_OF_PREFIX = {"intensor": INPUT, "outtensor": OUTPUT}
_SIDES = {side.value: side for side in Side}

_DEVPID = re.compile(r"^(\d+)_(\d+)$")
_TENSOR_FILE = re.compile(r"^(intensor|outtensor)(.+)\.bin$")


# -- the dump root ----------------------------------------------------------------------------

def dump_root(output: str) -> str:
    """`<output>/atb_dump_data`, or `output` itself when it already is that folder."""
    output = os.path.abspath(os.fspath(output))
    return output if os.path.basename(output) == DUMP_DIR else os.path.join(output, DUMP_DIR)


# -- processes and rounds ---------------------------------------------------------------------

def devpid(device: int, pid: int) -> str:
    """The `<dev>_<pid>` name of a process's folders and status file."""
    return f"{device}_{pid}"


def parse_devpid(name: str) -> tuple[int, int] | None:
    """(device, pid) of a `<dev>_<pid>` name, None for any other name."""
    m = _DEVPID.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def process_dir(devpid: str) -> str:
    """`data/<dev>_<pid>`: the rounds of one process."""
    return f"{DATA_DIR}/{devpid}"


def round_dir(devpid: str, index: int) -> str:
    """`data/<dev>_<pid>/<round>`: one round of one process."""
    return f"{DATA_DIR}/{round_in_data(devpid, index)}"


def round_in_data(devpid: str, index: int) -> str:
    """`<dev>_<pid>/<round>`: a round's folder below `data/`, the name the tools give a round."""
    return f"{devpid}/{index}"


def round_csv(round_rel: str) -> str:
    """The round's statistic.csv, below `round_rel` (relative or absolute)."""
    return f"{round_rel}/{CSV_FILE}"


def is_round_name(name: str) -> bool:
    """A folder name that can be a round: a round index in decimal."""
    return name.isdigit()


def round_index(name: str) -> int | None:
    """The round index a folder name stands for, None if it is not one."""
    return int(name) if name.isdigit() else None


def is_round_dir(path: str) -> bool:
    """Is `path` a round folder? Its name is a round index, and it holds statistic.csv or sits
    in a `<dev>_<pid>` folder (a round whose csv is not written yet, or was lost)."""
    path = os.path.abspath(path)
    if not is_round_name(os.path.basename(path)):
        return False
    if os.path.isfile(os.path.join(path, CSV_FILE)):
        return True
    return parse_devpid(os.path.basename(os.path.dirname(path))) is not None


def round_dir_of(path: str) -> str | None:
    """The round folder holding `path` (a file or folder below it), None outside any round."""
    d = os.path.dirname(os.path.abspath(path))
    while True:
        if is_round_dir(d):
            return d
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def below_round(path: str) -> str | None:
    """The part of a path written as `.../atb_dump_data/data/<dev>_<pid>/<round>/<rest>` below
    its round folder (`<rest>`), whatever machine or folder it was written on; else None."""
    marker = path.rfind(f"{DUMP_DIR}/{DATA_DIR}/")
    if marker < 0:
        return None
    parts = path[marker:].split("/", 4)
    return parts[4] if len(parts) == 5 and parts[4] else None


def process_of_round(round_path: str) -> str:
    """The `<dev>_<pid>` folder holding a round folder."""
    return os.path.dirname(os.path.abspath(round_path))


def root_of_process(process_path: str) -> str | None:
    """The `atb_dump_data` folder above a `data/<dev>_<pid>` folder, None when it is not in one."""
    data = os.path.dirname(os.path.abspath(process_path))
    root = os.path.dirname(data)
    if os.path.basename(data) == DATA_DIR and os.path.basename(root) == DUMP_DIR:
        return root
    return None


def is_data_dir(path: str) -> bool:
    """Is `path` the `atb_dump_data/data` folder?"""
    path = os.path.abspath(path)
    return os.path.basename(path) == DATA_DIR and \
        os.path.basename(os.path.dirname(path)) == DUMP_DIR


# -- ops --------------------------------------------------------------------------------------

def op_folder(own_id: int | str, name: str) -> str:
    """An op's folder name: `<own id>_<name>` (`2_LlamaDecoderLayer`)."""
    return f"{own_id}_{name}"


def child_op_dir(parent_rel: str, own_id: int | str, name: str) -> str:
    """The folder of a child op below its parent's folder (both relative to the round)."""
    return f"{parent_rel}/{own_id}_{name}"


def parse_op_folder(entry: str) -> tuple[str, str] | None:
    """(own id, name) of an op folder name, None for anything else (`before`, `after`, files)."""
    own_id, sep, name = entry.partition("_")
    return (own_id, name) if sep and own_id.isdigit() else None


def op_dir(round_rel: str, op_rel: str) -> str:
    """An op's folder from the dump root: its round's folder, then the op's below it."""
    return f"{round_rel}/{op_rel}"


def op_path(op_id: str, op_name: str) -> str:
    """The op's folder below the round, from its full ID and full name:
    (`2_1`, `LlamaDecoderLayer/LlamaAttention`) -> `2_LlamaDecoderLayer/1_LlamaAttention`."""
    return "/".join(f"{i}_{n}" for i, n in zip(op_id.split("_"), op_name.split("/")))


# -- tensor files -----------------------------------------------------------------------------

def side_dir(io: str) -> str:
    """The folder of an op's inputs (`before`) or outputs (`after`); `io` is input | output."""
    return _SIDE_DIR[io]


def tensor_dir(op_rel: str, io: str) -> str:
    """The folder of an op's input (`before`) or output (`after`) files below `op_rel`."""
    return f"{op_rel}/{_SIDE_DIR[io]}"


def tensor_name(io: str, index: str | int) -> str:
    """A tensor's name in op_param.json: `intensor<index>` or `outtensor<index>`."""
    return f"{_FILE_PREFIX[io]}{index}"


def tensor_file(io: str, index: str | int) -> str:
    """A tensor's file name: `intensor<index>.bin` (input) or `outtensor<index>.bin` (output)."""
    return f"{_FILE_PREFIX[io]}{index}.bin"


def tensor_rel(op_rel: str, io: str, index: str | int) -> str:
    """A tensor file's path below `op_rel` (an op folder, relative or absolute)."""
    return f"{op_rel}/{_SIDE_DIR[io]}/{_FILE_PREFIX[io]}{index}.bin"


def parse_side(cell: str) -> Side | None:
    """The side an Input/Output cell names, None for any other text."""
    return _SIDES.get(cell)


def parse_tensor_file(name: str) -> tuple[str, str] | None:
    """(io, index) of a tensor file name (`intensor0_x.bin` -> ("input", "0_x")), else None."""
    m = _TENSOR_FILE.match(name)
    return (_IO_OF_PREFIX[m.group(1)], m.group(2)) if m else None


# -- structure files and status -----------------------------------------------------------------

def info_kind_dir(kind: str) -> str:
    """`info/<kind>`: the structure files of one kind, every process's; kind is layer | model."""
    if kind not in INFO_KINDS:
        raise ValueError(f"info kind {kind!r}: expected one of {INFO_KINDS}")
    return f"{INFO_DIR}/{kind}"


def info_dir(kind: str, devpid: str) -> str:
    """`info/<kind>/<dev>_<pid>`; kind is layer | model."""
    return f"{info_kind_dir(kind)}/{devpid}"


def layer_info_dir(devpid: str, model: str | None = None) -> str:
    """The layer structure files of a process; those of every model but the first seen go to
    a `<Model>` folder below it (SPEC §5)."""
    base = info_dir("layer", devpid)
    return f"{base}/{model}" if model else base


def layer_info_file(name: str, op_id: str) -> str:
    """`<Layer>_<id>.json`: a layer-level op's structure file."""
    return f"{name}_{op_id}.json"


def model_info_dir(devpid: str) -> str:
    """`info/model/<dev>_<pid>`: the model structure files of a process."""
    return info_dir("model", devpid)


def model_info_file(model: str, phase: str) -> str:
    """`<Model>_<Phase>.json`: a model's layer list for one phase."""
    return f"{model}_{phase}.json"


def parse_info_file(name: str) -> str | None:
    """A structure file's name without `.json` (`LlamaForCausalLM_Prefill`,
    `LlamaDecoderLayer_2`), None for any other file."""
    return name[:-len(".json")] if name.endswith(".json") else None


def status_file(devpid: str) -> str:
    """The status file's name in `STATUS_DIR`: `<dev>_<pid>.json`."""
    return f"{devpid}.json"


def parse_status_file(name: str) -> str | None:
    """The `<dev>_<pid>` a status file name is for, None for other names (temporary files)."""
    if name.startswith(".") or not name.endswith(".json"):
        return None
    return name[:-len(".json")]
