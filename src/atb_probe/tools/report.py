"""The HTML report of a comparison: one self-contained file (inline CSS, SVG and a few lines of
JS for filtering the table; nothing fetched from the network).

The plot shows, per round, the relative error of every compared output in execution order —
‖target − golden‖ / ‖golden‖ in tensor mode, |Δnorm| / norm in statistics mode — on a log scale,
over alternating bands, one per layer-level op, so that the layer where the error jumps stands
out. Outputs that cross the thresholds are red; the first divergence is ringed.
"""
from __future__ import annotations

import datetime
import html
import math
from dataclasses import dataclass, field

from ..layout import Side
from .comparison import MatchMethod, PairMode, PairResult, Role
from .divergence import InputState, is_unknown, why_unknown
from .result import CompareResult
from .resulttable import FIELDS

REPORT_HTML = "atb_compare_report.html"
MAX_TABLE_ROWS = 5000
MAX_PLOTS = 8
_FLOOR, _CEIL = -12, 2        # log10 range of the plot's y axis

TABLE_COLUMNS = ("Target Execution Count", "Target Data Name", "Golden Data Name",
                 "Target Data Type", "Golden Data Type", "Target Data Shape", "Compare Mode",
                 "Match", "Cosine", "Max Absolute Err", "Max Relative Err",
                 "One Thousandth Err Ratio", "Five Thousandth Err Ratio", "Euc Distance",
                 "Relative Err of Norm(%)", "Diverged", "Note")
_TABLE_GETTERS = tuple(dict(FIELDS)[c] for c in TABLE_COLUMNS)


def relative_error(row: PairResult) -> float | None:
    """The plotted error of a row; None when the row has no data."""
    golden_norm = None if row.golden_stats is None else row.golden_stats.norm
    if row.mode == PairMode.TENSOR:
        euc = row.metrics.euc_distance
        if euc is None:
            return math.inf if row.note.startswith("nan_mismatch") else None
        if golden_norm is None or not math.isfinite(golden_norm):
            return 0.0 if euc == 0 else None     # NaN/Inf at the same places on both sides
        if not golden_norm:
            return 0.0 if euc == 0 else math.inf
        return euc / golden_norm
    if row.mode == PairMode.STATISTICS:
        rel = row.diffs.norm_rel_pct
        if rel is None:
            target_norm = None if row.target_stats is None else row.target_stats.norm
            if golden_norm is None or target_norm is None:
                return None
            if not math.isfinite(golden_norm) and not math.isfinite(target_norm):
                return None   # NaN/Inf on both sides: the norms say nothing about the rest
            return math.inf
        return rel / 100
    return None


def render_html(result: CompareResult) -> str:
    """The whole report as one HTML document."""
    parts = [_HEAD.format(title="atb-probe compare")]
    parts.append("<h1>atb-probe compare</h1>")
    parts.append(_finding_box(result))
    parts.append(_replay_box(result))
    parts.append(_summary(result))
    parts.append(_scan(result))
    parts.append(_plots(result))
    parts.append(_alignment(result))
    parts.append(_layers(result))
    parts.append(_table(result))
    parts.append(_SCRIPT)
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _escape(value) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value) -> str:
    if value is None:
        return "N/A"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _finding_box(result) -> str:
    f = result.finding
    if f is None:
        if not result.without_metrics():
            return (f"<div class='ok'><b>No divergence.</b> No output crosses "
                    f"{_escape(result.thresholds.describe())}.</div>")
        return (f"<div class='warn'><div class='big'>No divergence among the compared "
                f"outputs</div><div>{_escape(result.verdict_text())}</div></div>")
    cls = "bad" if f.inputs_clean else "warn"
    head = {InputState.CLEAN: "First divergence",
            InputState.UNKNOWN: "First crossing op (an input could not be compared)",
            InputState.CROSSING: "First crossing op (its inputs differ too)"}[f.inputs]
    where = f"<code>{_escape(f.op_path)}</code>"
    if f.golden_op_path != f.op_path:
        where += f" ↔ <code>{_escape(f.golden_op_path)}</code>"
    return (f"<div class='{cls}'><div class='big'>{head}: round {f.round_index}, "
            f"{where}</div><div>{_escape(_own(f.row))}: {_escape(f.metric())}</div>"
            f"<div class='{'' if f.inputs_clean else 'caveat'}'>{_escape(f.caveat())}</div>"
            f"<div>golden op: <code>{_escape(f.golden_op_path)}</code> · thresholds: "
            f"{_escape(result.thresholds.describe())}</div></div>")


def _replay_box(result) -> str:
    """With `compare --replay`: the kernel that made the divergence, or why none is named."""
    found = result.replay
    if found is None:
        return ""
    from .replay import Verdict
    verdict = found.verdict
    cls = {Verdict.INTRODUCED: "bad", Verdict.CLEAN: "ok"}.get(verdict, "warn")
    kernel = found.kernel
    if verdict == Verdict.INTRODUCED:
        head = (f"Replay: kernel <code>{_escape(kernel.job.op_id)}</code> "
                f"(<code>{_escape(kernel.op)}</code>) introduced the error")
    elif verdict == Verdict.INHERITED:
        head = ("Replay: no kernel introduced error; the first to differ from the golden "
                "inherited it")
    elif verdict == Verdict.SKIPPED:
        head = "Replay: no kernel could be replayed"
    else:
        head = "Replay: no kernel introduced error beyond its dtype"
    parts = [f"<div class='{cls} replay'><div class='big'>{head}</div>"]
    if kernel is not None:
        parts.append(f"<div>round {kernel.job.round_index}, <code>"
                     f"{_escape(kernel.job.op_path)}</code> · {_escape(kernel.verdict)}"
                     + (f" · carried by {_escape(kernel.carrier)}" if kernel.carrier else "")
                     + "</div>")
        parts.append(_replay_outputs(kernel))
    elif verdict == Verdict.SKIPPED:
        parts.append(f"<div>{_escape(found.why_none)}</div>")
    counts = ", ".join(f"{n} {_escape(v)}" for v, n in found.counts().items())
    if found.results:
        n = len(found.results)
        parts.append(f"<div>{_escape(found.started)}: {n} kernel{'s' if n > 1 else ''} "
                     f"replayed ({counts}).</div>")
    parts.append(f"<div>introduced only beyond the bound: {_escape(found.bound.describe())}"
                 "</div>")
    if not found.golden_paired:
        parts.append("<div class='caveat'>One side's ranks were joined: kernels were judged "
                     "without the golden's tensors.</div>")
    parts.append("</div>")
    return "".join(parts)


def _replay_outputs(kernel) -> str:
    """A replayed kernel's outputs: recorded against float64, the bound, against the golden."""
    rows = []
    for o in kernel.outputs:
        j = o.judgement
        golden = "—" if o.total is None else _fmt(o.total.metrics.cosine)
        if j is None:
            rows.append(f"<tr><td>{_escape(o.name)}</td><td>{_escape(o.dtype)}</td>"
                        f"<td colspan='6'>{_escape(o.note or 'not compared')}</td>"
                        f"<td>{golden}</td></tr>")
            continue
        rows.append(f"<tr class='{'bad' if j.introduced else ''}'><td>{_escape(o.name)}</td>"
                    f"<td>{_escape(o.dtype)}</td><td>{_fmt(j.error)}</td>"
                    f"<td>{_fmt(j.limit)}</td><td>{_fmt(j.rerun_error)}</td>"
                    f"<td>{j.nonfinite}</td><td>{_fmt(o.metrics.cosine)}</td>"
                    f"<td>{_fmt(o.metrics.max_abs_err)}</td><td>{golden}</td></tr>")
    return ("<table class='grid'><tr><th>output</th><th>dtype</th>"
            "<th>‖recorded − float64‖</th><th>bound</th><th>‖rerun in dtype − float64‖</th>"
            "<th>NaN/Inf introduced</th><th>cosine vs float64</th><th>max abs err vs float64"
            "</th><th>cosine vs golden</th></tr>" + "".join(rows) + "</table>")


def _own(row: PairResult) -> str:
    """`output.0` of `3_LlamaDecoderLayer/output.0`."""
    return row.name.rsplit("/", 1)[-1]


def _summary(result: CompareResult) -> str:
    rows = "".join(f"<tr><th>{_escape(k)}</th><td>{_escape(v)}</td></tr>"
                   for k, v in result.summary_lines() if k != "first divergence")
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    return (f"<h2>Summary</h2><table class='kv'>{rows}"
            f"<tr><th>generated</th><td>{stamp}</td></tr></table>")


def _plots(result) -> str:
    # One plot per round, or per round slice when rounds were paired by tokens (a tensor
    # compared whole goes with the slice it was compared in: the rows before it).
    rounds: dict[tuple, list[PairResult]] = {}
    titles: dict[tuple, str] = {}
    key = None
    for row in result.rows:
        if row.request or key is None or key[0] != row.round_index:
            key = (row.round_index, row.request, row.positions)
        if row.io == Side.OUTPUT:
            rounds.setdefault(key, []).append(row)
            if row.request or key not in titles:
                titles[key] = row.rounds_text()
    if not rounds:
        return ""
    keys = list(rounds)
    chosen = keys[:MAX_PLOTS]
    f = result.finding
    found = None if f is None else (f.round_index, f.request, f.positions)
    if found in rounds and found not in chosen:
        chosen.append(found)
    flagged = _flagged(result)
    out = ["<h2>Error along execution order</h2>",
           "<p>Relative error of each output (log scale): ‖target − golden‖ / ‖golden‖, or the "
           "relative norm error in statistics mode. Bands are layer-level ops; red points cross "
           "the thresholds; the ring marks the first divergence; equal tensors lie on the bottom "
           "line; a ? at the top marks an output without metrics (not judged). Hover a point "
           "for its name.</p>"]
    for key in chosen:
        out.append(f"<h3>round {_escape(titles[key])}</h3>")
        out.append(_svg(rounds[key], f if key == found else None, flagged))
    if len(keys) > len(chosen):
        out.append(f"<p>{len(keys) - len(chosen)} more round(s) not plotted; see the table.</p>")
    return "\n".join(out)


def _svg(rows: list[PairResult], finding, flagged: dict[tuple[str, str, int], str]) -> str:
    width, height, left, right, top, bottom = 1100, 300, 60, 10, 28, 30
    n = len(rows)
    plot_w, plot_h = width - left - right, height - top - bottom

    def x(i: int) -> float:
        return left + (i + 0.5) * plot_w / max(n, 1)

    def y(err: float) -> float:
        if err == 0:
            lg = _FLOOR
        elif math.isinf(err):
            lg = _CEIL
        else:
            lg = min(max(math.log10(err), _FLOOR), _CEIL)
        return top + (_CEIL - lg) * plot_h / (_CEIL - _FLOOR)

    svg = [f"<svg viewBox='0 0 {width} {height}' width='100%' role='img' "
           f"xmlns='http://www.w3.org/2000/svg'>"]
    # Bands, alternating, labelled when wide enough: one per layer-level op, or per child of
    # the layer when the round holds a single layer (a dump zoomed in with `ids`).
    keys = [row.layer for row in rows]
    if len(set(keys)) == 1:
        keys = ["/".join(row.name.split("/")[:2]) for row in rows]
    start, band = 0, 0
    for i in range(1, n + 1):
        if i == n or keys[i] != keys[start]:
            x0, x1 = left + start * plot_w / n, left + i * plot_w / n
            shade = "#e9eef6" if band % 2 else "#f8f9fb"
            band += 1
            label = keys[start].rsplit("/", 1)[-1]
            svg.append(f"<rect x='{x0:.1f}' y='{top}' width='{x1 - x0:.1f}' height='{plot_h}' "
                       f"fill='{shade}'><title>{_escape(keys[start])}</title></rect>")
            if x1 - x0 > 7 * min(len(label), 24):
                svg.append(f"<text x='{(x0 + x1) / 2:.1f}' y='{top - 8}' class='lbl' "
                           f"text-anchor='middle'>{_escape(label[:24])}</text>")
            start = i
    for lg in range(_FLOOR, _CEIL + 1, 2):
        yy = top + (_CEIL - lg) * plot_h / (_CEIL - _FLOOR)
        svg.append(f"<line x1='{left}' x2='{width - right}' y1='{yy:.1f}' y2='{yy:.1f}' "
                   f"class='grid'/><text x='{left - 6}' y='{yy + 4:.1f}' class='ax' "
                   f"text-anchor='end'>{'≤' if lg == _FLOOR else ''}1e{lg}</text>")
    svg.append(f"<text x='{left}' y='{height - 8}' class='ax'>execution order →</text>")
    for i, row in enumerate(rows):
        err = relative_error(row)
        if err is None:
            if is_unknown(row):
                tip = f"{row.name}\nno metrics: {why_unknown(row)}"
                svg.append(f"<text x='{x(i):.1f}' y='{top + 14}' class='unk' "
                           f"text-anchor='middle'>?<title>{_escape(tip)}</title></text>")
            continue
        bad = row.diverged is True
        tip = (f"{row.name}\nrelative error {_fmt(err)}\ncosine "
               f"{_fmt(row.metrics.cosine)}\nmax abs err {_fmt(row.metrics.max_abs_err)}")
        svg.append(f"<circle cx='{x(i):.1f}' cy='{y(err):.1f}' r='{3 if bad else 2.2}' "
                   f"class='{'pb' if bad else 'pg'}'><title>{_escape(tip)}</title></circle>")
        if _key(row) in flagged:
            svg.append(f"<rect x='{x(i) - 5:.1f}' y='{y(err) - 5:.1f}' width='10' height='10' "
                       f"class='nf'><title>{_escape(flagged[_key(row)])}</title></rect>")
        if finding is not None and row is finding.row:
            svg.append(f"<circle cx='{x(i):.1f}' cy='{y(err):.1f}' r='8' class='ring'/>")
    svg.append("</svg>")
    return "".join(svg)


@dataclass(slots=True)
class _LayerOutputs:
    """The compared outputs of one layer-level op (and of the ops inside it) in one round."""

    outputs: int = 0
    crossing: int = 0
    unknown: int = 0                 # outputs without metrics
    min_cosine: float | None = None
    max_error: float | None = None   # relative_error

    def add(self, row: PairResult) -> None:
        self.outputs += 1
        self.crossing += row.diverged is True
        self.unknown += is_unknown(row)
        cos = row.metrics.cosine
        if cos is not None:
            self.min_cosine = cos if self.min_cosine is None else min(self.min_cosine, cos)
        err = relative_error(row)
        if err is not None:
            self.max_error = err if self.max_error is None else max(self.max_error, err)


def _layers(result) -> str:
    layers: dict[tuple[int, str], _LayerOutputs] = {}
    for row in result.rows:
        if row.io == Side.OUTPUT:
            layers.setdefault((row.round_index, row.layer), _LayerOutputs()).add(row)
    if not layers:
        return ""
    body = "".join(
        f"<tr class='{'bad' if e.crossing else ''}'><td>{_escape(r)}</td>"
        f"<td>{_escape(layer)}</td><td>{e.outputs}</td><td>{e.crossing}</td>"
        f"<td>{e.unknown}</td>"
        f"<td>{_fmt(e.min_cosine)}</td><td>{_fmt(e.max_error)}</td></tr>"
        for (r, layer), e in layers.items())
    return ("<h2>Per layer</h2><table class='grid'><tr><th>round</th><th>layer</th>"
            "<th>outputs</th><th>crossing</th><th>without metrics</th><th>min cosine</th>"
            f"<th>max relative error</th></tr>{body}</table>")


def _key(row: PairResult) -> tuple[str, str, int]:
    """A target tensor's key in `_flagged`: (process, tensor name, round)."""
    return (row.target.process, row.target.data_name, row.target.round_index)


def _flagged(result: CompareResult) -> dict[tuple[str, str, int], str]:
    """Tensors of the target that the scan flagged: key -> why."""
    marks = {}
    for scanned in result.scan:
        if scanned.side != Role.TARGET:
            continue
        if scanned.first is not None:
            marks[(scanned.process, scanned.first.tensor, scanned.round_index)] = \
                f"first NaN/Inf of round {scanned.round_index}"
        for g in scanned.growth:
            marks.setdefault((scanned.process, g.tensor, scanned.round_index),
                             f"magnitude grows x{g.ratio:.3g} over its inputs")
    return marks


def _scan(result: CompareResult) -> str:
    """What `atb-probe scan` finds in the compared tensors of each side."""
    items = []
    for scanned in result.scan:
        where = f"{_escape(scanned.side)} {_escape(scanned.process)} round {scanned.round_index}"
        if scanned.first is not None:
            items.append(f"<li><b>{where}:</b> {_escape(scanned.first.summary(scanned))}</li>")
        for g in scanned.growth[:20]:
            items.append(f"<li>{where}: growth warning: {_escape(g.summary())}</li>")
        if len(scanned.growth) > 20:
            items.append(f"<li>{where}: {len(scanned.growth) - 20} more growth warnings</li>")
    if not items:
        return ("<h2>NaN/Inf and overflow</h2><p>No compared tensor of either side holds NaN or "
                "Inf, and no op's output grows far above its inputs.</p>")
    return ("<h2>NaN/Inf and overflow</h2><div class='scan'><p>From the compared tensors of "
            "each side (as <code>atb-probe scan</code> reads a dump). Marked ⚠ in the table and "
            "with a square in the plots (target side).</p><ul>" + "".join(items) + "</ul></div>")


@dataclass(slots=True)
class _RoundPairing:
    """What was compared in one pair of rounds, and how its ops were paired."""

    tensors: int = 0
    crossing: int = 0
    unknown: int = 0                     # rows without metrics
    ops: dict[MatchMethod, set[str]] = field(default_factory=dict)   # op paths by Match

    def add(self, row: PairResult) -> None:
        self.tensors += 1
        self.crossing += row.diverged is True
        self.unknown += is_unknown(row)
        self.ops.setdefault(row.match, set()).add(row.op_path)


def _alignment(result: CompareResult) -> str:
    """Which rounds of each side were paired, how their ops were paired, the ops that could
    not be judged and what could not be paired at all."""
    pairings: dict[tuple, _RoundPairing] = {}
    for row in result.rows:
        key = (row.golden.process, row.golden.round_index, row.target.process,
               row.target.round_index)
        pairings.setdefault(key, _RoundPairing()).add(row)
    body = "".join(
        f"<tr><td>{_escape(gp)} / {gr}</td><td>{_escape(tp)} / {tr}</td><td>{p.tensors}</td>"
        + "".join(f"<td>{len(p.ops.get(m, ()))}</td>" for m in MatchMethod)
        + f"<td>{p.unknown}</td><td>{p.crossing}</td></tr>"
        for (gp, gr, tp, tr), p in pairings.items())
    head = "".join(f"<th>ops by {_escape(m)}</th>" for m in MatchMethod)
    parts = ["<h2>Alignment</h2><p>Rounds are paired by process (device) and round number; "
             "ops by ID, else by name, by the op map, or by execution order and output shapes "
             "(the Match column of the table).</p>"
             "<table class='grid'><tr><th>golden process / round</th>"
             f"<th>target process / round</th><th>tensor pairs</th>{head}"
             f"<th>without metrics</th><th>crossing</th></tr>{body}</table>"]
    parts.append(_unjudged(result))
    parts.append(_unmatched(result))
    return "\n".join(parts)


def _unjudged(result: CompareResult) -> str:
    if not result.unjudged:
        return "<h3>Ops that could not be judged</h3><p>None: every op has metrics.</p>"
    body = "".join(f"<tr><td>{u.round_index}</td><td><code>{_escape(u.op_path)}</code></td>"
                   f"<td><code>{_escape(u.golden_op_path or '—')}</code></td>"
                   f"<td>{_escape(u.why)}</td></tr>"
                   for u in result.unjudged[:MAX_TABLE_ROWS])
    return ("<h3>Ops that could not be judged</h3><p class='caveat'>Their outputs have no "
            "metrics, so whether they went wrong is not known: neither diverged nor clean. An "
            "error found after one of them may start there.</p><table class='grid'><tr>"
            "<th>round</th><th>target op</th><th>golden op</th><th>why</th></tr>"
            f"{body}</table>")


def _unmatched(result: CompareResult) -> str:
    if not result.unmatched:
        return "<h3>Unmatched</h3><p>Everything was matched.</p>"
    listed = sorted(result.unmatched, key=lambda u: u.expected)[:MAX_TABLE_ROWS]
    body = "".join(f"<tr><td>{_escape(u.side)}</td><td>{_escape(u.kind)}</td>"
                   f"<td>{_escape(u.where)}</td><td><code>{_escape(u.what)}</code></td>"
                   f"<td>{u.count}</td><td>"
                   f"{'no counterpart by convention' if u.expected else _escape(u.kind.reason)}"
                   "</td></tr>"
                   for u in listed)
    return ("<h3>Unmatched</h3><p>Present in one dump only (the two runs executed different ops "
            "there, or were dumped with different filters), or, by the op map's conventions, "
            "without a counterpart.</p><table class='grid'><tr>"
            "<th>only in</th><th>kind</th><th>where</th><th>what</th><th>count</th><th>why</th>"
            f"</tr>{body}</table>")


def _table(result) -> str:
    rows = result.rows[:MAX_TABLE_ROWS]
    head = "".join(f"<th>{_escape(c)}</th>" for c in TABLE_COLUMNS)
    flagged = _flagged(result)
    body = []
    for row in rows:
        cls = "bad" if row.diverged else ""
        cells = "".join(f"<td>{_escape(_fmt(get(row)))}</td>" for get in _TABLE_GETTERS)
        mark = flagged.get(_key(row))
        if mark:
            cls += " nf"
            cells = cells.replace("<td>", f"<td title='{_escape(mark)}'>⚠ ", 1)
        body.append(f"<tr class='{cls.strip()}'>{cells}</tr>")
    more = (f"<p>Showing the first {MAX_TABLE_ROWS} of {len(result.rows)} rows; the CSV and "
            ".xlsx hold all of them.</p>" if len(result.rows) > MAX_TABLE_ROWS else "")
    return ("<h2>All compared tensors</h2><p><input id='flt' placeholder='filter by name' "
            "size='40'> <label><input type='checkbox' id='onlybad'> only crossing</label></p>"
            f"{more}<table class='grid' id='tbl'><tr>{head}</tr>{''.join(body)}</table>")


_HEAD = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 13px/1.4 system-ui, sans-serif; margin: 20px; color: #222; }}
code {{ font-size: 12px; }}
.big {{ font-size: 17px; font-weight: 600; margin-bottom: 4px; }}
div.bad, div.warn, div.ok {{ padding: 10px 14px; border-radius: 6px; margin: 10px 0; }}
div.bad {{ background: #fde8e8; border: 1px solid #e0a0a0; }}
div.warn {{ background: #fff6dd; border: 1px solid #e0c070; }}
div.ok {{ background: #e6f6e6; border: 1px solid #9c9; }}
div.replay table.grid {{ margin: 6px 0; background: #fff; }}
.caveat {{ color: #8a5a00; font-weight: 600; }}
.unk {{ fill: #8a5a00; font-size: 13px; font-weight: 700; }}
table.grid {{ border-collapse: collapse; }}
table.grid td, table.grid th {{ border: 1px solid #ddd; padding: 2px 6px; white-space: nowrap; }}
table.grid tr.bad td {{ background: #fde8e8; }}
table.kv th {{ text-align: left; padding-right: 12px; }}
line.grid {{ stroke: #ddd; }}
.ax, .lbl {{ font-size: 10px; fill: #555; }}
.pg {{ fill: #3366aa; }} .pb {{ fill: #cc2222; }}
.ring {{ fill: none; stroke: #cc2222; stroke-width: 2; }}
.nf {{ fill: none; stroke: #8a2be2; stroke-width: 2; }}
table.grid tr.nf td:first-child {{ color: #8a2be2; font-weight: 600; }}
div.scan {{ background: #f3ecfb; border: 1px solid #b9a0d8; padding: 10px 14px;
            border-radius: 6px; }}
</style></head><body>"""

_SCRIPT = """<script>
(function () {
  var flt = document.getElementById('flt'), bad = document.getElementById('onlybad');
  var rows = document.querySelectorAll('#tbl tr');
  function apply() {
    var q = flt.value.toLowerCase();
    for (var i = 1; i < rows.length; i++) {
      var r = rows[i], show = r.textContent.toLowerCase().indexOf(q) >= 0;
      if (bad.checked && r.className.split(' ').indexOf('bad') < 0) show = false;
      r.style.display = show ? '' : 'none';
    }
  }
  if (flt) { flt.oninput = apply; bad.onchange = apply; }
})();
</script>"""
