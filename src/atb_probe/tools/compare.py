"""`atb-probe compare GOLDEN TARGET [-o OUT]`: compare two dumps tensor by tensor.

GOLDEN and TARGET are dumps opened at the same level (roots, `<dev>_<pid>` folders or round
folders; see dumpreader). The pipeline: shards.py makes the ranks of one tensor-parallel run one
side (against a golden of one process); align.py pairs processes, rounds, ops and tensors (by
ID, by name, by an op map, or by execution order and shape between two implementations); the
pieces of a joined side's tensors are joined where they are loaded; metrics.py compares each
pair; divergence.py judges them and finds the first diverging op; scan.py looks at each side's
compared tensors for NaN/Inf and overflow. The stages share the
records of comparison.py; the whole result (result.py) is written by the renderers:
resulttable.py (`atb_compare_result.csv` and `.xlsx`, msprobe's columns first), summary.py
(`atb_compare_summary.json`, for scripts and CI) and report.py (`atb_compare_report.html`).
With `--replay`, culprit.py then reruns the target's kernels from the first divergence on
(replay.py) and the renderers add the kernel it names.

Compare mode per tensor (`--mode auto`, the default): tensor metrics when both sides have the
bytes, else statistics differences from the csv (or from the bytes of the side that has them),
else `no data`.

Rounds paired by tokens (align.py): a tensor that has its round's token dimension is compared
on the request's tokens only (`TensorRef.cut`, applied where the worker loads it), once per
slice pair; its statistics are then those of request_statistic.csv when the slice is the
request's whole span in its round, and none otherwise (the row's note says why). A tensor
without it (a weight) is compared whole, once per pair of rounds, and judged with every slice.

Scale: the alignment reads only the statistic.csv files, in this process; the pairs are then
cut into batches (`BATCH_ELEMENTS`, `BATCH_PAIRS`) and compared `--jobs` at a time in worker
processes (jobs.py). A worker holds one pair of tensors at a time and reduces it in chunks, so
memory grows with the number of jobs, not with the dump; the rows (a few hundred bytes each)
are collected here, in execution order.
"""
from __future__ import annotations

import math
import os
import sys
import threading
from contextlib import ExitStack
from dataclasses import dataclass

from ..layout import Side
from ..statcsv import is_empty_shape, parse_shape, shape_cell
from ..tokens import Arrangement
from . import extras
from .align import Alignment, RoundPair, TensorPair, align_dumps
from .arrays import ReadBuffer, load_values
from .comparison import (CompareError, CompareMode, CutDims, MatchMethod, PairMode, PairResult,
                         Positions, RefPair, Role, RoundNumbers, TensorRef, Thresholds,
                         TokenSlice, Unmatched, UnmatchedKind)
from .divergence import Finding, OpRows, crosses, judge
from .dumpreader import DumpError, DumpLevel, NoData, open_dump
from .jobs import default_jobs, progress_bar, worker_pool
from .metrics import array_stats, compare_arrays, stats_metrics
from .conventions import choose, op_names
from .opmap import OpMap, load_map
from .result import CompareResult
from .scan import scan_compared
from .shards import JoinedRanks, find_ranks, joined_note, load_joined
from .tokenpairs import SideSlice
from .triage import triage

MODES = tuple(mode.value for mode in CompareMode)
BATCH_ELEMENTS = 1 << 23     # elements per batch sent to a worker (32 MB of float32 per side)
BATCH_PAIRS = 512            # and at most this many pairs: small tensors cost per file


@dataclass(slots=True)
class _OpSpan:
    """A compared op pair and the places of its tensor pairs in the work."""

    round_index: int
    op_path: str                 # the target's
    golden_op_path: str
    indices: list[int]
    request: str = ""
    positions: Positions | None = None

    def rows(self, rows: list[PairResult]) -> OpRows:
        """The op with the compared rows of its tensors (`rows`: the results of the work)."""
        own = [rows[i] for i in self.indices]
        return OpRows(self.round_index, self.op_path, self.golden_op_path,
                      [r for r in own if r.io == Side.INPUT],
                      [r for r in own if r.io == Side.OUTPUT], request=self.request,
                      positions=self.positions)


@dataclass(slots=True)
class _Slicing:
    """What the alignment says of one pair of the work: the request and positions it was cut
    to, and why a cut side has no statistics."""

    request: str = ""
    positions: Positions | None = None
    note: str = ""


def compare_dumps(golden: str, target: str, mode: CompareMode | str = CompareMode.AUTO,
                  thresholds: Thresholds = Thresholds(), progress=None, jobs: int = 1,
                  opmap: OpMap | None = None, batch_elements: int = BATCH_ELEMENTS,
                  conventions: bool = True, full: bool = False,
                  tolerance: float = 0.0) -> CompareResult:
    """Compare two dumps; `progress(total)` may return a callable advanced by a count of
    tensor pairs as they are done. `jobs` > 1 compares batches of pairs in that many worker
    processes at once. `opmap`: the user's map, over the built-in one the dumps' op names
    choose (`conventions`: whether to look for one). In `auto` mode, the data of only the
    tensors that can change the verdict is read (triage.py; `tolerance`: how far statistics
    may differ and still agree), unless `full`."""
    try:
        mode = CompareMode(mode)
    except ValueError:
        raise CompareError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}") from None
    try:
        g_dump, t_dump = open_dump(golden), open_dump(target)
    except DumpError as exc:
        raise CompareError(str(exc)) from None
    if (g_dump.kind == DumpLevel.ROUND) != (t_dump.kind == DumpLevel.ROUND):
        raise CompareError(
            f"GOLDEN is a {g_dump.kind} folder but TARGET is a {t_dump.kind} folder: give two "
            "round folders (data/<dev>_<pid>/<round>), or two dump roots / process folders")
    ranks = find_ranks(g_dump, t_dump)
    if ranks is not None:    # one side's ranks are one side, aligned as its rank 0
        g_dump, t_dump = ranks.lead(g_dump, t_dump)
    chosen = choose(op_names(g_dump), op_names(t_dump), opmap, automatic=conventions)
    alignment: Alignment = align_dumps(g_dump, t_dump, chosen and chosen.opmap,
                                       chosen and chosen.left)
    work: list[RefPair] = []
    slicing: list[_Slicing] = []
    spans: list[_OpSpan] = []
    alone: list[OpRows] = []     # ops of the target with no counterpart: not judged
    round_ends = []
    whole: dict[tuple[int, int], dict[int, int]] = {}   # round pair -> tensor pair -> work
    targets = set()
    # Target op subtrees the op map says have no counterpart (vLLM's sampler, the kernels inside
    # a fused module): expected, not ops that could not be judged.
    conventional = {(u.where, u.what) for u in alignment.unmatched
                    if u.expected and u.side == Role.TARGET and u.kind == UnmatchedKind.OP}
    for rp in alignment.rounds:
        round_ends.append(len(work))
        if id(rp.target) not in targets:   # a round paired with slices of several: once
            targets.add(id(rp.target))
            alone += _target_only(rp, conventional)
        once = whole.setdefault((id(rp.golden), id(rp.target)), {})
        request, positions = (rp.tokens.label, rp.tokens.positions) if rp.tokens else ("", None)
        for op in rp.ops:
            indices = []
            for p in op.tensors:
                # An allocation kernel's output holds whatever the memory held: nothing to
                # compare.
                if p.golden.uninitialized or p.target.uninitialized:
                    continue
                pair, per_token, note = _ref_pair(p, rp, ranks)
                if rp.tokens is not None and not per_token:
                    index = once.get(id(p))
                    if index is not None:     # compared with an earlier slice of these rounds
                        indices.append(index)
                        continue
                    once[id(p)] = len(work)
                    slicing.append(_Slicing())
                else:
                    slicing.append(_Slicing(request, positions, note))
                indices.append(len(work))
                work.append(pair)
            spans.append(_OpSpan(rp.target.index, op.target.op_path, op.golden.op_path,
                                 indices, request, positions))
    def finish(index: int, row: PairResult) -> None:
        sliced = slicing[index]
        row.request, row.positions = sliced.request, sliced.positions
        if sliced.note and row.mode == PairMode.NO_DATA:
            row.note = "; ".join(filter(None, (sliced.note, row.note)))
        row.diverged = crosses(row, thresholds)

    report = None
    if full or mode != CompareMode.AUTO:
        rows = run_pairs(work, mode, jobs, progress, batch_elements)
        for index, row in enumerate(rows):
            finish(index, row)
        ops = sorted([span.rows(rows) for span in spans] + alone, key=lambda op: op.finished)
        verdict = judge(ops)
    else:
        with _Reader(work, mode, jobs, batch_elements) as reader:
            triaged = triage(work, spans, alone, reader.read, finish, tolerance,
                             advance=progress(len(work)) if progress else None)
        rows, verdict, report = triaged.rows, triaged.verdict, triaged.report
    finding = verdict.finding
    round_ends.append(len(rows))
    rows = [r for start, end in zip(round_ends, round_ends[1:])
            for r in sorted(rows[start:end], key=lambda r: r.order)]
    if finding is not None:
        finding.first_inside = _first_inside(rows, finding)
    numbers = dict.fromkeys(RoundNumbers(rp.golden.index, rp.target.index)
                            for rp in alignment.rounds)
    return CompareResult(g_dump.path, t_dump.path, mode, thresholds, rows, alignment.unmatched,
                         finding, list(numbers), alignment.name_matched, scan_compared(rows),
                         max(1, jobs), verdict.unjudged, alignment.pairing.text(),
                         chosen.opmap.title() if chosen else "",
                         ranks.summary if ranks is not None else None, triage=report)


def _refs(pair, ranks, rp: RoundPair) -> tuple[TensorRef, TensorRef]:
    """The (golden, target) refs of a tensor pair; on a side of joined ranks, the whole's."""
    if ranks is None:
        return TensorRef.of(pair.golden), TensorRef.of(pair.target)
    return ranks.refs(pair.golden, pair.target, _whole_shape(pair, ranks.role, rp))


def _whole_shape(pair: TensorPair, joined: Role, rp: RoundPair) -> tuple[int, ...] | None:
    """The shape the joined side's tensor has as a whole, when the two sides lay their tokens
    out differently (vLLM's flat `[tokens, hidden]` against a batch's `[rows, seq, hidden]`):
    the other side's tensor with its token dimensions replaced by the joined side's round's;
    None when the other side's shape is the whole's."""
    if rp.tokens is None:
        return None
    other_role = Role.TARGET if joined == Role.GOLDEN else Role.GOLDEN
    mine, theirs = rp.tokens.side(joined).layout, rp.tokens.side(other_role).layout
    if mine.arrangement == theirs.arrangement:
        return None
    other = pair.target if joined == Role.GOLDEN else pair.golden
    try:
        dims = parse_shape(other.shape)
    except ValueError:
        return None
    if not theirs.has_token_dim(dims):
        return None
    flat = Arrangement.FLAT
    features = dims[1:] if theirs.arrangement == flat else dims[2:]
    tokens = (mine.tokens,) if mine.arrangement == flat else (mine.rows, mine.tokens)
    return (*tokens, *features)


def _ref_pair(pair: TensorPair, rp: RoundPair, ranks: JoinedRanks | None
              ) -> tuple[RefPair, bool, str]:
    """The refs of a tensor pair of a round pair, cut to the pair's tokens where they have
    them; whether either side holds tokens of its round (else the two are compared whole);
    and why a cut side has no statistics, if one has none."""
    refs, per_token, notes = [], False, []
    for role, record, ref in zip((Role.GOLDEN, Role.TARGET), (pair.golden, pair.target),
                                 _refs(pair, ranks, rp)):
        if rp.tokens is not None:
            tokens, note = _cut(ref, record, rp.tokens.side(role))
            per_token = per_token or tokens
            if note:
                notes.append(f"{role}: {note}")
        refs.append(ref)
    return RefPair(refs[0], refs[1], pair.method), per_token, "; ".join(notes)


def _cut(ref: TensorRef, record, side: SideSlice) -> tuple[bool, str]:
    """Cut `ref` to the slice's tokens when its tensor has them: whether it holds tokens of its
    round (cut or not), and why its statistics are gone, if they are."""
    try:
        dims = parse_shape(record.shape)
    except ValueError:
        return False, ""
    layout, span = side.layout, side.span
    if layout.has_token_dim(dims):
        if side.whole_round:
            return True, ""
        ref.cut = TokenSlice(CutDims(layout.arrangement.value), span.row, side.start, side.stop)
        if side.whole_span:
            if getattr(record, "parts", None):    # derived: statistics only if measured
                ref.stats = record.request_stats(span.request)
                why = (f"{ref.data_name} is derived from other tensors, and round "
                       f"{ref.round_index} has no statistics of it over request "
                       f"{span.request!r} (derived_statistic.csv)")
            else:
                ref.stats = record.round.request_stats(record, span.request)
                why = (f"round {ref.round_index} has no statistics of request "
                       f"{span.request!r} (request_statistic.csv)")
        else:
            ref.stats = None
            held = Positions(span.position, span.position + span.stop - span.start)
            why = (f"the statistics of round {ref.round_index} are over positions {held} of "
                   "the request, this pair compares part of them")
    elif layout.arrangement == Arrangement.BATCH and layout.rows > 1 and dims \
            and dims[0] == layout.rows * layout.tokens:
        # The batch's tokens flattened (`[batch * seq, hidden]`, the input of a matmul kernel).
        offset = span.row * layout.tokens
        ref.cut = TokenSlice(CutDims.FLAT, 0, offset + side.start, offset + side.stop)
        ref.stats = None
        why = "no statistics of a flattened batch's request tokens"
    elif side.whole_span and layout.has_request_rows(dims):
        # A request's tensor that is not per token (the logits of its last token): a batch
        # row, or in a flat layout the request's place among the round's requests (vLLM's
        # logits); over the same tokens as the other side's when both spans are whole.
        ref.cut = TokenSlice(CutDims.ROW, layout.request_row(span))
        ref.stats = record.request_stats(span.request) if getattr(record, "parts", None) \
            else record.round.request_stats(record, span.request)
        why = (f"round {ref.round_index} has no statistics of request {span.request!r}'s row "
               "(request_statistic.csv)")
    else:
        return False, ""
    ref.shape = shape_cell(ref.cut.shape(dims))
    return True, "" if ref.stats is not None else why


def _target_only(rp: RoundPair, conventional: set[tuple[str, str]]) -> list[OpRows]:
    """The ops of a round pair's target that no golden op was paired with, where they ran,
    but for those in a subtree the op map says has no counterpart (`conventional`: (where,
    op path) of such subtrees)."""
    paired = {op.target.op_path for op in rp.ops}
    where = rp.target.where

    def expected(path: str) -> bool:
        parts = path.split("/")
        return any((where, "/".join(parts[:k])) in conventional
                   for k in range(1, len(parts) + 1))

    return [OpRows(rp.target.index, op.op_path, "", [], [],
                   done=min(t.order for t in (op.outputs or op.tensors)))
            for op in rp.target.ops if op.op_path not in paired and not expected(op.op_path)]


def run_pairs(work: list[RefPair], mode: CompareMode, jobs: int = 1, progress=None,
              batch_elements: int = BATCH_ELEMENTS, pool=None) -> list[PairResult]:
    """Compare every pair of `work`, in order; in `jobs` processes when there is more than one
    batch of work (in `pool`, when one is given). Memory: each job holds one pair of tensors
    (and its chunk buffers) at a time."""
    advance = progress(len(work)) if progress else None
    batches = _batches(work, batch_elements)
    if jobs <= 1 or len(batches) <= 1:
        rows = []
        for batch in batches:
            rows.extend(compare_batch(batch, mode))
            if advance:
                advance(len(batch))
        return rows
    rows = []
    with ExitStack() as stack:
        if pool is None:
            pool = stack.enter_context(worker_pool(min(jobs, len(batches))))
        for batch, done in zip(batches, pool.map(compare_batch, batches,
                                                 [mode] * len(batches))):
            rows.extend(done)
            if advance:
                advance(len(batch))
    return rows


class _Reader:
    """Reads pairs of the work for the triage, several times, in one pool of workers started
    when a read first needs it (`with _Reader(...) as reader: reader.read(indices)`)."""

    def __init__(self, work: list[RefPair], mode: CompareMode, jobs: int, batch_elements: int):
        self.work, self.mode, self.jobs, self.batch_elements = work, mode, jobs, batch_elements
        self.stack = ExitStack()
        self.pool = None

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc) -> bool:
        self.stack.close()
        return False

    def read(self, indices: list[int]) -> list[PairResult]:
        """The compared rows of these pairs of the work, their data read."""
        pairs = [self.work[i] for i in indices]
        if self.pool is None and self.jobs > 1 and len(_batches(pairs, self.batch_elements)) > 1:
            self.pool = self.stack.enter_context(worker_pool(self.jobs))
        return run_pairs(pairs, self.mode, self.jobs, None, self.batch_elements, self.pool)


def _batches(work: list[RefPair], batch_elements: int) -> list[list[RefPair]]:
    """Consecutive pairs in batches of about `batch_elements` elements to read (a pair without
    files costs nothing: a statistics dump is one batch, compared here)."""
    batches, current, size = [], [], 0
    for item in work:
        n = max(_numel(ref.shape) if ref.path else 0 for ref in (item.golden, item.target))
        if current and (size + n > batch_elements or len(current) >= BATCH_PAIRS):
            batches.append(current)
            current, size = [], 0
        current.append(item)
        size += n
    if current:
        batches.append(current)
    return batches


def _numel(shape: str) -> int:
    """The elements of a tensor by its Shape cell; 0 for one whose shape is not known."""
    try:
        return math.prod(parse_shape(shape))
    except ValueError:
        return 0


def compare_batch(batch: list[RefPair], mode: CompareMode) -> list[PairResult]:
    """The results of a batch of pairs (run in a worker process)."""
    return [compare_pair(p.golden, p.target, mode, p.match) for p in batch]


def _first_inside(rows: list[PairResult], finding: Finding) -> str:
    """The earliest crossing tensor of the found op's children (a weight shows up here)."""
    prefix = finding.op_path + "/"
    for row in rows:
        if row.round_index == finding.round_index and row.diverged \
                and row.op_path.startswith(prefix) and (
                    not row.request or (row.request, row.positions)
                    == (finding.request, finding.positions)):
            return row.name
    return ""


def compare_pair(golden: TensorRef, target: TensorRef, mode: CompareMode = CompareMode.AUTO,
                 match: MatchMethod = MatchMethod.ID) -> PairResult:
    """The comparison of one pair of tensors."""
    row = PairResult(golden, target, match)
    if is_empty_shape(golden.shape) and is_empty_shape(target.shape):
        row.note = "empty tensor"
        return row
    notes = []
    for side, ref in ((Role.GOLDEN, golden), (Role.TARGET, target)):
        note = joined_note(ref.pieces)
        if note:
            notes.append(f"{side}: {note}")
        if ref.pieces is not None and ref.pieces.join is None:
            row.note = "; ".join(notes)    # never compared as if one rank's piece were all
            return row
    g_arr = t_arr = None
    if mode != CompareMode.STATISTICS or golden.stats is None or target.stats is None:
        buffers = _buffers()
        g_arr, g_why = _load(golden, buffers[0])
        t_arr, t_why = _load(target, buffers[1])
        for side, why in ((Role.GOLDEN, g_why), (Role.TARGET, t_why)):
            if why and not any(n.startswith(f"{side}: ") for n in notes):  # said it already
                notes.append(f"{side}: {why}")
    g_stats, t_stats = golden.stats, target.stats
    if g_arr is not None and t_arr is not None and mode != CompareMode.STATISTICS:
        # Two implementations lay tensors out differently (`1x4x32`, `4x32`); ops paired by
        # ID or name are the same code, where a shape difference is a finding.
        compared = compare_arrays(g_arr, t_arr, loose_shapes=not MatchMethod(match).same_code)
        row.metrics, note = compared.metrics, compared.note
        g_stats, t_stats = compared.golden_stats, compared.target_stats
        row.mode = PairMode.TENSOR
        if note:
            notes.insert(0, note)
        else:
            if golden.dtype != target.dtype:
                notes.append(f"dtype differs ({golden.dtype} vs {target.dtype}): compared as "
                             "float")
            if golden.shape != target.shape:
                notes.append(f"shape {golden.shape} vs {target.shape}: compared element by "
                             "element")
    else:
        if g_arr is not None and (mode != CompareMode.STATISTICS or g_stats is None):
            g_stats = array_stats(g_arr)
        if t_arr is not None and (mode != CompareMode.STATISTICS or t_stats is None):
            t_stats = array_stats(t_arr)
        if g_stats is not None and t_stats is not None and mode != CompareMode.TENSOR:
            row.mode = PairMode.STATISTICS
    if g_stats is not None and t_stats is not None:
        row.diffs = stats_metrics(g_stats, t_stats)
    row.golden_stats, row.target_stats = g_stats, t_stats
    row.note = "; ".join(notes)
    return row


_BUFFERS = threading.local()  # a thread compares one pair at a time: its two sides' memory


def _buffers() -> tuple[ReadBuffer, ReadBuffer]:
    buffers = getattr(_BUFFERS, "pair", None)
    if buffers is None:
        buffers = _BUFFERS.pair = (ReadBuffer(), ReadBuffer())
    return buffers


def _load(ref: TensorRef, buffer: ReadBuffer):
    """A ref's values (derived from its parts, joined from its ranks' pieces, cut to its
    tokens) and a note: why there are none, or that ranks meant to agree do not."""
    try:
        if ref.derive is not None:
            # The parts are alive together: none of them goes into the shared buffer.
            loaded = [_load(p, ReadBuffer()) for p in ref.parts]
            missing = next((why for values, why in loaded if values is None), None)
            if missing is not None:
                return None, missing
            values = ref.derive.apply([values for values, _ in loaded])
            note = "; ".join(why for _, why in loaded if why)
        elif ref.pieces is not None:
            values, note = load_joined(ref.pieces)
        else:
            values, note = load_values(ref.path, buffer), ""
    except NoData as exc:
        return None, str(exc)
    except ValueError as exc:
        return None, f"cannot derive {ref.data_name}: {exc}"
    if ref.cut is None:
        return values, note
    cut = ref.cut.apply(values)
    if shape_cell(cut.shape) != ref.shape:
        return None, (f"the data's shape {shape_cell(values.shape)} does not hold the "
                      f"request's tokens {ref.shape}")
    return cut, note


def write_outputs(result: CompareResult, out: str, xlsx: bool = True,
                  html: bool = True) -> list[str]:
    """Write the CSV, the JSON summary, the .xlsx and the HTML report into `out`; their
    paths."""
    from .report import REPORT_HTML, render_html
    from .resulttable import RESULT_CSV, RESULT_XLSX, XLSX_MAX_ROWS, write_csv, write_xlsx
    from .summary import SUMMARY_JSON, write_summary
    if os.path.exists(out) and not os.path.isdir(out):
        raise CompareError(f"--output {out} is not a folder")
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, RESULT_CSV), os.path.join(out, SUMMARY_JSON)]
    write_csv(result, paths[0])
    write_summary(result, paths[1])
    if xlsx and len(result.rows) >= XLSX_MAX_ROWS:
        print(f"atb-probe compare: {len(result.rows)} rows do not fit in an .xlsx sheet; "
              f"skipped it (the CSV has them all)", file=sys.stderr)
    elif xlsx:
        paths.append(os.path.join(out, RESULT_XLSX))
        write_xlsx(result, paths[-1])
    if html:
        paths.append(os.path.join(out, REPORT_HTML))
        with open(paths[-1], "w", encoding="utf-8") as f:
            f.write(render_html(result))
    return paths


# -- command line --------------------------------------------------------------------------------

def register(sub) -> None:
    p = sub.add_parser(
        "compare", help="compare two dumps and find the first diverging operator",
        description="Compare the tensors of TARGET with those of GOLDEN (dump roots, "
                    "<dev>_<pid> folders or round folders), write a CSV, a JSON summary, an "
                    ".xlsx and an HTML report, and name the first operator whose output "
                    "diverges while its inputs do not.",
        epilog="exit status: 0 when the comparison ran, whatever it found (with "
               "--fail-on-divergence: 1 when it found a divergence); 1 when no tensor could "
               "be paired; 2 for a usage error (a bad argument, a path that is not a dump, a "
               "bad map file) or results that could not be written. "
               "example: atb-probe compare fp32 bf16 -o cmp --min-ratio 0")
    p.add_argument("golden", help="the reference dump")
    p.add_argument("target", help="the dump to check")
    p.add_argument("-o", "--output", default="compare_output",
                   help="folder for the results (default: ./compare_output)")
    p.add_argument("--mode", choices=MODES, default=CompareMode.AUTO.value,
                   help="tensor: metrics from the data; statistics: from statistic.csv; auto "
                        "(default): tensor where both sides have data, else statistics")
    d = Thresholds()
    p.add_argument("--min-cosine", type=float, default=d.min_cosine, metavar="C",
                   help=f"an output with cosine below C diverges (default {d.min_cosine})")
    p.add_argument("--min-ratio", type=float, default=d.min_ratio, metavar="R",
                   help="an output whose share of elements within 1‰ relative error is below "
                        f"R diverges (default {d.min_ratio}; 0 turns this test off)")
    p.add_argument("--max-norm-err", type=float, default=d.max_norm_err, metavar="PCT",
                   help="statistics mode: an output whose norm differs by more than PCT "
                        f"percent diverges (default {d.max_norm_err})")
    p.add_argument("--full", action="store_true",
                   help="read the data of every tensor pair; by default (mode auto) compare "
                        "reads the statistics first and the data only of the layer-level ops "
                        "that can change the verdict (see docs/analysis.md)")
    p.add_argument("--stats-tolerance", type=float, default=0.0, metavar="REL",
                   help="statistics of two tensors that differ by at most REL (relative) "
                        "count as equal, and their layer-level op is not read (default 0: "
                        "only identical statistics)")
    p.add_argument("--map", metavar="FILE",
                   help="YAML or JSON file saying which ops and tensors of one dump are which "
                        "of the other's (see docs/analysis.md), for dumps of two "
                        "implementations; its entries win over the built-in conventions")
    p.add_argument("--no-conventions", action="store_true",
                   help="do not use the built-in conventions (vLLM against transformers) "
                        "that compare otherwise chooses from the dumps' module classes")
    p.add_argument("-j", "--jobs", type=int, default=None, metavar="N",
                   help="worker processes comparing tensors at once (default: the cores "
                        f"available, here {default_jobs()})")
    p.add_argument("--fail-on-divergence", action="store_true",
                   help="exit with status 1 when a divergence is found (for CI); the results "
                        "are written all the same")
    p.add_argument("--replay", action="store_true",
                   help="then replay the target's kernels from the first divergence on, from "
                        "their own recorded inputs (as `atb-probe replay --until-culprit`), and "
                        "name the first that introduced error; needs a target dumped with "
                        "save_child and task tensor or all")
    p.add_argument("--no-xlsx", action="store_true", help="skip the .xlsx file")
    p.add_argument("--no-html", action="store_true", help="skip the HTML report")
    p.set_defaults(func=_compare)


def _compare(args) -> int:
    needed = ("rich",) if args.no_xlsx else ("rich", "pandas", "openpyxl")
    if not extras.require("compare", *needed):
        return 2
    from rich.console import Console
    err = Console(stderr=True)
    thresholds = Thresholds(args.min_cosine, args.min_ratio, args.max_norm_err)
    jobs = default_jobs() if args.jobs is None else args.jobs
    if jobs < 1:
        print("atb-probe compare: --jobs must be at least 1", file=sys.stderr)
        return 2
    if not args.stats_tolerance >= 0:
        print("atb-probe compare: --stats-tolerance must be 0 or more", file=sys.stderr)
        return 2
    try:
        opmap = load_map(args.map) if args.map else None
        with progress_bar(err, "comparing") as progress:
            result = compare_dumps(args.golden, args.target, args.mode, thresholds, progress,
                                   jobs, opmap, conventions=not args.no_conventions,
                                   full=args.full, tolerance=args.stats_tolerance)
    except CompareError as exc:
        print(f"atb-probe compare: {exc}", file=sys.stderr)
        return 2
    if args.replay and result.rows:
        from .culprit import search
        from .replay import ReplaySettings
        result.replay = search(result, ReplaySettings(thresholds=thresholds), jobs, opmap,
                               conventions=not args.no_conventions)
    out = Console(highlight=False, soft_wrap=True, markup=False)   # names hold brackets
    if result.conventions:
        out.print(f"conventions: {result.conventions}")
    if not result.rows:
        out.print("no tensor of TARGET could be paired with one of GOLDEN: are they dumps of "
                  "the same model, at the same level?")
        _print_unmatched(out, result.unmatched, sheet=None)
        return 1
    try:
        paths = write_outputs(result, args.output, xlsx=not args.no_xlsx,
                              html=not args.no_html)
    except (CompareError, OSError) as exc:
        print(f"atb-probe compare: cannot write the results: {exc}", file=sys.stderr)
        return 2
    c = result.counts()
    out.print(f"compared {len(result.rows)} tensors in {len(result.rounds)} round(s), paired "
              f"{result.pairing}: {c.tensor} by tensor, {c.statistics} by statistics, "
              f"{c.no_data} without data; {c.crossing} cross the thresholds")
    if result.triage is not None:
        out.print(result.triage.text())
    if result.ranks is not None:
        _print_ranks(out, result.ranks)
    if result.name_matched_ops:
        out.print(f"{result.name_matched_ops} op(s) were paired by name, map or execution "
                  "order because the two runs' op structures differ there (column Match)")
    sheet = next((p for p in paths if p.endswith(".xlsx")), None)
    _print_unmatched(out, result.unmatched, sheet)
    if result.finding:
        style = "bold red" if result.finding.inputs_clean else "bold yellow"
    else:
        style = "yellow" if result.without_metrics() else "green"
    out.print(result.verdict_text(), style=style)
    for scanned in result.scan:
        if scanned.first is not None:
            out.print(f"{scanned.side}: {scanned.first.summary(scanned)}", style="bold red")
    if result.replay is not None:
        _print_replay(out, result.replay)
    for path in paths:
        out.print(f"wrote {path}")
    return 1 if args.fail_on_divergence and result.finding is not None else 0


def _print_replay(out, found) -> None:
    """What replay found from the first divergence on (culprit.CulpritSearch)."""
    from .replay import Verdict
    counts = found.counts()
    if found.results:
        n = len(found.results)
        out.print(f"replay: {found.started}: {n} kernel{'s' if n > 1 else ''} replayed, "
                  + ", ".join(f"{k} {v}" for v, k in counts.items()))
    style = {Verdict.INTRODUCED: "bold red", Verdict.INHERITED: "bold yellow",
             Verdict.SKIPPED: "yellow"}.get(found.verdict, "green")
    out.print(f"replay: {found.text()}", style=style)


def _print_ranks(out, ranks: JoinedRanks, limit: int = 10) -> None:
    """That one side's ranks were joined, and the tensors whose pieces could not be."""
    out.print(f"{ranks.role}: {ranks.describe()}")
    if not ranks.undecided:
        return
    out.print(f"{len(ranks.undecided)} tensors of the {ranks.role} were not compared: their "
              "ranks' pieces could not be joined (column Note):")
    for u in ranks.undecided[:limit]:
        out.print(f"  {u.name}: {u.reason}")
    if len(ranks.undecided) > limit:
        out.print(f"  ... and {len(ranks.undecided) - limit} more")


def _print_unmatched(out, unmatched: list[Unmatched], sheet: str | None,
                     limit: int = 10) -> None:
    """The entries of one side only; `sheet`: the .xlsx that lists them all, if one was
    written."""
    expected = sum(1 for u in unmatched if u.expected)
    if expected:
        out.print(f"{expected} entries have no counterpart by convention (the op map says so)")
    unmatched = [u for u in unmatched if not u.expected]
    if not unmatched:
        return
    where = f" (all of them in sheet 'unmatched' of {sheet})" if sheet else ""
    out.print(f"{len(unmatched)} entries could not be matched{where}:")
    for u in unmatched[:limit]:
        out.print(f"  only in {u.side}: {u.kind} {u.where}: {u.what}"
                  + (f" ({u.count} ops)" if u.kind == UnmatchedKind.OP and u.count > 1 else ""))
    if len(unmatched) > limit:
        out.print(f"  ... and {len(unmatched) - limit} more")
