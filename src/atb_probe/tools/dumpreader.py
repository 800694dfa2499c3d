"""Iterating a dump: processes, rounds, ops and tensors with their statistic.csv rows.

A dump is read from the outside, the way msprobe reads one, so it works on trees this project did
not write. The index of a round is its `statistic.csv` (SPEC §5): one row per tensor, in the order
the tensors were written, which is execution order (an op's inputs when it starts, its outputs when
it ends, its children's rows in between). A round without a csv is indexed by walking its folders;
its order is then rebuilt from the op IDs (inputs, children by ID, outputs).

    from atb_probe.tools.dumpreader import open_dump
    for proc in open_dump("out/atb_dump_data").processes:
        for rnd in proc.rounds:
            for op in rnd.ops:
                for t in op.tensors:
                    print(t.data_name, t.row["Max"], t.load().shape)

Any of these paths can be opened: the folder holding `atb_dump_data`, `atb_dump_data` itself, its
`data` folder, a `<dev>_<pid>` folder or a round folder.
"""
from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass, field
from functools import cached_property

from .. import layout
from ..binfile import BinFormatError
from ..binread import HeaderOnlyError, load_numpy, load_tensor
from ..config import Task
from ..layout import Side
from ..naming import is_uninitialized
from ..statcsv import COLUMNS, DERIVED_FILE_NAME, NA, Stats, parse_stats, shape_cell
from ..tokens import TokenLayout
from . import StrEnum
from .tokens import read_layout, read_request_stats


class DumpError(Exception):
    """A path that is not a dump (or not the part of one that was asked for)."""


class NoData(Exception):
    """A tensor whose bytes are not in the dump (statistics task, header-only file, missing)."""


@dataclass
class TensorRecord:
    """One tensor of one op in one round: its csv row and where its bytes are."""

    round: "Round"
    op_id: str               # `2_1_0`
    op_name: str             # `LlamaDecoderLayer/LlamaAttention/Linear`
    io: Side | str           # a Side; the cell as written when it names neither side
    index: str               # `0`, `0_hidden_states`
    dtype: str               # csv name: float, bf16, int64...
    shape: str               # the Shape cell: `1x4x32`
    stats: Stats | None      # from the csv
    path: str | None         # the .bin file (maybe a reference), None when there is none
    order: int               # position in the round, execution order
    row: dict = field(repr=False)

    @property
    def id_parts(self) -> tuple[str, ...]:
        return tuple(self.op_id.split("_"))

    @property
    def name_parts(self) -> tuple[str, ...]:
        return tuple(self.op_name.split("/"))

    @property
    def op_path(self) -> str:
        """`2_LlamaDecoderLayer/1_LlamaAttention`: the op's folder below the round."""
        return layout.op_path(self.op_id, self.op_name)

    @property
    def data_name(self) -> str:
        """msprobe's name for the tensor: `<op path>/input.0`."""
        return f"{self.op_path}/{self.io}.{self.index}"

    @property
    def uninitialized(self) -> bool:
        """An output over memory nothing had written (an allocation kernel's, `torch.empty`,
        or a view of it): whatever the memory held, never a finding."""
        if self.io != Side.OUTPUT:
            return False
        op_type = self.name_parts[-1]
        if is_uninitialized(op_type, self.io):
            return True
        return op_type.endswith("Kernel") and \
            layout.tensor_name(self.io, self.index) in self.round.uninitialized(self.op_path)

    @property
    def layer(self) -> str:
        """The layer-level op this tensor belongs to: `2_LlamaDecoderLayer`."""
        return layout.op_folder(self.id_parts[0], self.name_parts[0])

    def load(self):
        """The values as a numpy array (bf16/fp8 as float32); `NoData` when there are none."""
        return self._read(load_numpy)

    def load_tensor(self):
        """The values as a torch tensor of the dumped dtype; `NoData` when there are none."""
        return self._read(load_tensor)

    def _read(self, loader):
        if self.path is None:
            raise NoData("no .bin file (Tensor Path is N/A: task=statistics, or a file the "
                         "probe could not write)")
        try:
            return loader(self.path)
        except HeaderOnlyError:
            raise NoData("header-only file (filter_level 2): statistics only") from None
        except FileNotFoundError:
            raise NoData(f"{self.path} does not exist") from None
        except BinFormatError as exc:
            raise NoData(f"unreadable: {exc}") from None


@dataclass
class Op:
    """An op of a round with the tensors written for it, in execution order."""

    op_id: str
    op_name: str
    tensors: list[TensorRecord]

    @property
    def inputs(self) -> list[TensorRecord]:
        return [t for t in self.tensors if t.io == Side.INPUT]

    @property
    def outputs(self) -> list[TensorRecord]:
        return [t for t in self.tensors if t.io == Side.OUTPUT]

    @property
    def op_path(self) -> str:
        return self.tensors[0].op_path

    @property
    def depth(self) -> int:
        return len(self.op_id.split("_"))


class Round:
    """One execution round of one process: `data/<dev>_<pid>/<round>/`."""

    def __init__(self, path: str, process: "Process"):
        self.path = path
        self.process = process
        name = os.path.basename(path)
        index = layout.round_index(name)
        self.index = -1 if index is None else index

    def __repr__(self) -> str:
        return f"Round({self.where})"

    @property
    def where(self) -> str:
        """`<dev>_<pid>/<round>`: how the tools name the round."""
        return layout.round_in_data(self.process.name, self.index)

    @property
    def csv_path(self) -> str:
        return layout.round_csv(self.path)

    @property
    def modules(self) -> RoundModules:
        """The model and module paths of this round, from the structure files."""
        return self.process.modules.get(self.index) or RoundModules()

    @cached_property
    def tensors(self) -> list[TensorRecord]:
        """Every tensor of the round in execution order."""
        if os.path.isfile(self.csv_path):
            return self._from_csv()
        return self._from_folders()

    @cached_property
    def tokens(self) -> TokenLayout | None:
        """The round's token layout (tokens.json), None when it has none; `tokens.LayoutError`
        when it cannot be read."""
        return read_layout(self.path)

    @cached_property
    def _request_stats(self) -> dict[tuple[str, str, str, str], Stats]:
        return read_request_stats(self.path)

    def request_stats(self, record: TensorRecord, request: str) -> Stats | None:
        """A tensor's statistics over one request's tokens (request_statistic.csv: `request`
        as tokens.json names it); None when the round has none for it."""
        return self._request_stats.get((record.op_id, str(record.io), record.index, request))

    @cached_property
    def _derived_stats(self) -> dict[tuple[str, str, str, str], Stats]:
        return read_request_stats(self.path, DERIVED_FILE_NAME)

    def derived_stats(self, op_id: str, io: str, index: str, request: str = "") -> Stats | None:
        """The statistics the probe measured of a sum of an op side's tensors
        (derived_statistic.csv: `index` such as `0+1`), over the whole sum or one request's
        tokens; None when the round has none."""
        return self._derived_stats.get((op_id, str(io), index, request))

    def uninitialized(self, op_path: str) -> frozenset:
        """The output names an op's op_param.json marks as uninitialised memory."""
        cache = self.__dict__.setdefault("_uninitialized", {})
        names = cache.get(op_path)
        if names is None:
            try:
                with open(os.path.join(self.path, op_path, layout.OP_PARAM)) as f:
                    marked = json.load(f).get("uninitialized") or ()
                names = frozenset(marked if isinstance(marked, list) else ())
            except (OSError, ValueError, AttributeError):
                names = frozenset()
            cache[op_path] = names
        return names

    @cached_property
    def ops(self) -> list[Op]:
        """Every op that has tensors, ordered by its first tensor."""
        by_id: dict[str, Op] = {}
        for t in self.tensors:
            op = by_id.get(t.op_id)
            if op is None:
                by_id[t.op_id] = op = Op(t.op_id, t.op_name, [])
            op.tensors.append(t)
        return list(by_id.values())

    @cached_property
    def task(self) -> Task | None:
        """What the round was dumped with, as its rows show; None for a round without rows."""
        rows = self.tensors
        if not rows:
            return None
        has_stats = any(t.stats is not None for t in rows)
        has_files = any(t.row.get("Tensor Path", NA) != NA for t in rows)
        if has_stats and has_files:
            return Task.ALL
        return Task.STATISTICS if has_stats else Task.TENSOR

    def _from_csv(self) -> list[TensorRecord]:
        records = []
        with open(self.csv_path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                return []
            names = list(COLUMNS) if len(header) == len(COLUMNS) else header
            for cells in reader:
                if len(cells) != len(names):
                    continue  # the line a killed writer left half-written, as msprobe skips it
                row = dict(zip(names, cells))
                ids, ops = row["Op Id"].split("_"), row["Op Name"].split("/")
                if len(ids) != len(ops):
                    continue
                side = layout.parse_side(row["Input/Output"])  # None: another tool's word
                records.append(TensorRecord(
                    round=self, op_id=row["Op Id"], op_name=row["Op Name"],
                    io=side or row["Input/Output"],
                    index=row["Index"], dtype=row["Dtype"], shape=row["Shape"],
                    stats=parse_stats(row), path=self._locate(row, side), order=len(records),
                    row=row))
        return records

    def _locate(self, row: dict, side: Side | None) -> str | None:
        """The .bin of a row: its Tensor Path re-rooted at this round (the tree may have moved,
        as msprobe assumes), else the path as written, else the path the layout gives."""
        written = row.get("Tensor Path", NA)
        if written and written != NA:
            below = layout.below_round(written)
            if below:
                candidate = os.path.join(self.path, below)
                if os.path.isfile(candidate):
                    return candidate
            if os.path.isfile(written):
                return written
        if side is None:
            return None
        candidate = layout.tensor_rel(
            os.path.join(self.path, layout.op_path(row["Op Id"], row["Op Name"])), side,
            row["Index"])
        return candidate if os.path.isfile(candidate) else None

    def _from_folders(self) -> list[TensorRecord]:
        from ..binfile import read_header
        records: list[TensorRecord] = []

        def visit(folder: str, ids: list[str], names: list[str]) -> None:
            op_id, op_name = "_".join(ids), "/".join(names)
            for io in Side:
                if io == Side.OUTPUT:
                    for child in op_folders(folder):
                        visit(child.path, ids + [child.own_id], names + [child.name])
                if not ids:
                    continue
                for index, path in _tensor_files(folder, io):
                    try:
                        header = read_header(path)
                        dtype, shape = header.dtype.csv_name, shape_cell(header.dims)
                    except (OSError, BinFormatError):
                        dtype = shape = "?"
                    row = dict.fromkeys(COLUMNS, NA)
                    row.update({"Device and PID": self.process.name,
                                "Execution Count": str(self.index), "Op Name": op_name,
                                "Op Type": names[-1], "Op Id": op_id, "Input/Output": io.value,
                                "Index": index, "Dtype": dtype, "Format": "nd", "Shape": shape,
                                "Tensor Path": path})
                    records.append(TensorRecord(self, op_id, op_name, io, index, dtype, shape,
                                                None, path, len(records), row))

        visit(self.path, [], [])
        return records


@dataclass(frozen=True, slots=True)
class OpFolder:
    """An op's folder on disk, `<own id>_<name>`, below its round's or its parent op's."""

    own_id: str
    name: str
    path: str


def op_folders(folder: str) -> list[OpFolder]:
    """The op folders directly below `folder` (a round's or an op's), in ID order."""
    found = []
    for entry in os.listdir(folder):
        op = layout.parse_op_folder(entry)
        full = os.path.join(folder, entry)
        if op is not None and os.path.isdir(full):
            found.append(OpFolder(*op, full))
    return sorted(found, key=lambda f: (int(f.own_id), f.own_id, f.name))


def _tensor_files(op_folder: str, io: Side) -> list[tuple[str, str]]:
    """(index, path) of the tensor files of one side of an op, in index order."""
    folder = layout.tensor_dir(op_folder, io)
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        parsed = layout.parse_tensor_file(name)
        path = os.path.join(folder, name)
        if parsed is not None and parsed[0] == io and os.path.isfile(path):
            found.append((parsed[1], path))
    return sorted(found, key=lambda f: _index_key(f[0]))


class Process:
    """The rounds one process dumped: `data/<dev>_<pid>/`."""

    def __init__(self, path: str, rounds: list[str] | None = None):
        self.path = path
        self.name = os.path.basename(path)
        self.device, self.pid = layout.parse_devpid(self.name) or (-1, -1)
        if rounds is None:
            rounds = [os.path.join(path, d) for d in os.listdir(path)
                      if layout.is_round_name(d) and os.path.isdir(os.path.join(path, d))]
        self.rounds = sorted((Round(r, self) for r in rounds), key=lambda r: r.index)

    def __repr__(self) -> str:
        return f"Process({self.name}, {len(self.rounds)} rounds)"

    @cached_property
    def modules(self) -> dict[int, RoundModules]:
        """The model and module paths of each round (by index), from the structure files; none
        for a process folder outside an `atb_dump_data` tree."""
        root = layout.root_of_process(self.path)
        return module_paths(root, self.name) if root else {}


@dataclass(slots=True)
class RoundModules:
    """What a process's structure files say of one of its rounds."""

    model: str | None = None                      # the model's name
    phase: str | None = None                      # Prefill, Decoder or Forward
    paths: dict[str, str] = field(default_factory=dict)   # op ID -> module path

    def leaf(self, op_id: str) -> str | None:
        """The last part of an op's module path (`q_proj`), None for a kernel or an op the
        structure files do not name."""
        path = self.paths.get(op_id)
        return path.rsplit(".", 1)[-1] if path else None


def module_paths(root: str, proc: str) -> dict[int, RoundModules]:
    """The model and module paths of each round (by index) from a process's structure files
    (SPEC §5): each model file names its rounds; its layer files (in a folder of the model's
    name for every model but the first) give the paths of the ops below the layer-level ones."""
    model_dir = os.path.join(root, layout.model_info_dir(proc))
    layer_dir = os.path.join(root, layout.layer_info_dir(proc))
    out: dict[int, RoundModules] = {}
    layer_paths: dict[str, dict[str, str]] = {}
    for doc in _json_files(model_dir):
        model = doc.get("modelType")
        if not isinstance(model, str):
            continue
        if model not in layer_paths:
            folder = os.path.join(root, layout.layer_info_dir(proc, model))
            paths = layer_paths[model] = {}
            for layer in _json_files(folder if os.path.isdir(folder) else layer_dir):
                _collect_paths(layer, paths)
        phase = doc.get("phase")
        modules = RoundModules(model, phase if isinstance(phase, str) else None,
                               dict(layer_paths[model]))
        _collect_paths({"nodes": doc.get("nodes", [])}, modules.paths)
        for pair in doc.get("rounds") or []:
            if isinstance(pair, list) and len(pair) == 2 and all(isinstance(i, int) for i in pair):
                for index in range(pair[0], pair[1] + 1):
                    out[index] = modules
    return out


def _json_files(folder: str):
    try:
        names = sorted(n for n in os.listdir(folder) if layout.parse_info_file(n) is not None)
    except OSError:
        return
    for name in names:
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            yield doc


def _collect_paths(node: dict, paths: dict[str, str]) -> None:
    for child in node.get("nodes") or []:
        if not isinstance(child, dict):
            continue
        name, kind, path = child.get("opName"), child.get("opType"), child.get("modulePath")
        if isinstance(name, str) and isinstance(kind, str) and isinstance(path, str):
            paths.setdefault(name[len(kind) + 1:], path)
        _collect_paths(child, paths)


class DumpLevel(StrEnum):
    """The level a dump was opened at."""

    ROOT = "root"            # atb_dump_data, the folder holding it, or its data folder
    PROCESS = "process"      # a `<dev>_<pid>` folder
    ROUND = "round"          # a round folder


class Dump:
    """A dump opened at some level (`kind`)."""

    def __init__(self, path: str, kind: DumpLevel, processes: list[Process], root: str | None):
        self.path = path
        self.kind = kind
        self.processes = processes
        self.root = root  # the atb_dump_data folder, when the path is inside one

    @property
    def rounds(self) -> list[Round]:
        return [r for p in self.processes for r in p.rounds]

    def info_files(self, sub: str) -> dict[str, list[str]]:
        """`info/<sub>/<dev>_<pid>/*.json` per process name (sub: layer | model)."""
        out: dict[str, list[str]] = {}
        if self.root is None:
            return out
        for p in self.processes:
            folder = os.path.join(self.root, layout.info_dir(sub, p.name))
            if os.path.isdir(folder):
                out[p.name] = sorted(os.path.join(folder, n) for n in os.listdir(folder)
                                     if layout.parse_info_file(n) is not None)
        return out


def open_dump(path: str) -> Dump:
    """Open a dump at any of its levels; `DumpError` says what was expected instead."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise DumpError(f"{path} does not exist")
    if not os.path.isdir(path):
        raise DumpError(f"{path} is a file; give a dump folder (for one .bin file use "
                        "`atb-probe parse`)")
    if os.path.isdir(layout.dump_root(path)):
        path = layout.dump_root(path)
    data = os.path.join(path, layout.DATA_DIR)
    if os.path.isdir(data) and not layout.is_round_dir(path):
        return Dump(path, DumpLevel.ROOT, _processes(data), path)
    if layout.is_data_dir(path):
        return Dump(path, DumpLevel.ROOT, _processes(path), os.path.dirname(path))
    if layout.is_round_dir(path):
        parent = layout.process_of_round(path)
        proc = Process(parent, [path])
        return Dump(path, DumpLevel.ROUND, [proc], layout.root_of_process(parent))
    if layout.parse_devpid(os.path.basename(path)) or \
            any(layout.is_round_name(d) for d in os.listdir(path)):
        proc = Process(path)
        if proc.rounds:
            return Dump(path, DumpLevel.PROCESS, [proc], layout.root_of_process(path))
    raise DumpError(f"{path} is not a dump: expected a folder holding atb_dump_data/, "
                    "atb_dump_data/ itself, a data/<dev>_<pid> folder or a round folder "
                    "(data/<dev>_<pid>/<round>, holding statistic.csv)")


def _processes(data: str) -> list[Process]:
    procs = [Process(os.path.join(data, d)) for d in sorted(os.listdir(data))
             if os.path.isdir(os.path.join(data, d))]
    return sorted(procs, key=lambda p: (p.device, p.pid, p.name))


def _index_key(index: str):
    head, _, rest = index.partition("_")
    return (int(head), rest) if head.isdigit() else (math.inf, index)
