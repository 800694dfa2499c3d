"""compare's statistics-first triage against the full comparison (`--full`), on real dumps of a
tiny Llama: a planted fault (a perturbed weight) and a clean pair, with and without
statistics in the dump. The triage must name the same first divergence while opening far
fewer `.bin` files (counted with an audit hook on `open`, in this process: `jobs=1`)."""
from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from atb_probe import cli
from atb_probe.tools.compare import compare_dumps
from atb_probe.tools.triage import AFTER_NOTE, AGREED_NOTE

from conftest import dump, generate, tiny_llama
from harness import config

LAYERS = 4
PERTURBED = "4_LlamaDecoderLayer"      # layers[2]


def perturb(model):
    """Scale the third layer's MLP output projection by 5%."""
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight.mul_(1.05)
    return model


def llama_dump(tmp_path_factory, name, task, broken=False):
    model = tiny_llama(layers=LAYERS)
    if broken:
        perturb(model)
    tmp = tmp_path_factory.mktemp(name)
    return dump(tmp, config(task=task, save_child=True, filter_level=1),
                lambda: generate(model, prompt_len=4, new_tokens=3))


@pytest.fixture(scope="module", params=["all", "tensor"])
def dumps(request, tmp_path_factory):
    """(golden, a second golden run, the faulty run) with `task` all or tensor."""
    task = request.param
    return task, tuple(llama_dump(tmp_path_factory, f"{task}-{name}", task, name == "broken")
                       for name in ("golden", "again", "broken"))


_OPENED: list[str] | None = None


def _count_bins(event, args):
    if _OPENED is not None and event == "open" and str(args[0]).endswith(".bin"):
        _OPENED.append(str(args[0]))


sys.addaudithook(_count_bins)


def opening(**kw):
    """The comparison and the `.bin` files it opened."""
    global _OPENED
    _OPENED = []
    try:
        result = compare_dumps(jobs=1, **kw)
        return result, _OPENED
    finally:
        _OPENED = None


def test_the_triage_names_the_full_compares_first_divergence_from_a_few_files(dumps):
    task, (golden, _, broken) = dumps
    full, full_opened = opening(golden=str(golden), target=str(broken), full=True)
    triaged, opened = opening(golden=str(golden), target=str(broken))
    f, t = full.finding, triaged.finding
    assert f is not None and f.inputs_clean and f.op_path.startswith(PERTURBED)
    assert t is not None and (t.round_index, t.op_path, t.golden_op_path, t.inputs) == \
        (f.round_index, f.op_path, f.golden_op_path, f.inputs)
    assert t.summary() == f.summary() and t.first_inside == f.first_inside
    assert full.triage is None and triaged.triage.stopped
    assert triaged.triage.read < triaged.triage.pairs == len(full.rows) == len(triaged.rows)
    # Statistics let it skip every layer before the fault but the margin's; without them it
    # reads the first round up to the fault, and never the rounds after it.
    assert len(opened) < len(full_opened) / (6 if task == "all" else 3)
    notes = {r.note for r in triaged.rows if r.note.startswith("not read")}
    assert notes == ({AGREED_NOTE, AFTER_NOTE} if task == "all" else {AFTER_NOTE})


def test_the_found_layers_inputs_were_read_and_match(dumps):
    """The margin: the whole layer-level op holding the finding is read, and its inputs
    match, so nothing that came into it differs."""
    _, (golden, _, broken) = dumps
    result, _ = opening(golden=str(golden), target=str(broken))
    f = result.finding
    inputs = [r for r in result.rows if r.round_index == f.round_index
              and r.op_path == PERTURBED and r.io == "input"]
    assert inputs and all(r.mode == "tensor" and r.diverged is False for r in inputs
                          if r.note != "empty tensor")
    layer = [r for r in result.rows if r.round_index == f.round_index
             and r.op_path.split("/")[0] == PERTURBED]
    assert not any(r.note.startswith("not read") for r in layer)


def test_a_clean_pair_has_no_divergence_either_way(dumps):
    task, (golden, again, _) = dumps
    full, full_opened = opening(golden=str(golden), target=str(again), full=True)
    triaged, opened = opening(golden=str(golden), target=str(again))
    assert full.finding is None and triaged.finding is None
    assert not triaged.triage.stopped
    if task == "all":    # identical statistics everywhere: nothing to read
        assert opened == [] and triaged.triage.read == 0
        assert {r.mode for r in triaged.rows} <= {"statistics", "no data"}
    else:                # nothing to decide by: every pair is read, as in the full comparison
        assert sorted(opened) == sorted(full_opened)
        assert triaged.triage.read == triaged.triage.pairs


def test_cli_says_what_it_read_and_full_reads_everything(dumps, tmp_path, capsys):
    _, (golden, _, broken) = dumps
    out = tmp_path / "triage"
    assert cli.main(["compare", str(golden), str(broken), "-o", str(out), "--no-xlsx",
                     "--no-html", "--jobs", "1"]) == 0
    text = capsys.readouterr().out
    summary = json.loads((out / "atb_compare_summary.json").read_text())
    assert summary["triage"]["read"] < summary["triage"]["pairs"]
    assert f"read the data of {summary['triage']['read']} of " in text
    out = tmp_path / "full"
    assert cli.main(["compare", str(golden), str(broken), "-o", str(out), "--no-xlsx",
                     "--no-html", "--jobs", "1", "--full"]) == 0
    full_text = capsys.readouterr().out
    full = json.loads((out / "atb_compare_summary.json").read_text())
    assert full["triage"] is None and "read the data of" not in full_text
    assert full["first_divergence"] == summary["first_divergence"]
    assert full["verdict"] == summary["verdict"]


def _pair(golden_stats, target_stats, shapes=("4x8", "4x8")):
    from atb_probe.layout import Side
    from atb_probe.statcsv import Stats
    from atb_probe.tools.comparison import MatchMethod, RefPair, TensorRef

    def ref(stats, shape):
        return TensorRef("0_Linear/output.0", "0_1", 0, "float", shape,
                         None if stats is None else Stats(*stats), "x.bin", 0, "0_Linear",
                         Side.OUTPUT)
    return RefPair(ref(golden_stats, shapes[0]), ref(target_stats, shapes[1]), MatchMethod.ID)


@pytest.mark.parametrize("golden, target, shapes, tolerance, agreed", [
    ((1.0, -1.0, 0.1, 2.0), (1.0, -1.0, 0.1, 2.0), ("4x8", "4x8"), 0.0, True),
    ((1.0, -1.0, 0.1, 2.0), (1.0, -1.0, 0.1, 2.0000001), ("4x8", "4x8"), 0.0, False),
    ((1.0, -1.0, 0.1, 2.0), (1.0, -1.0, 0.1, 2.0000001), ("4x8", "4x8"), 1e-6, True),
    ((1.0, -1.0, 0.1, 2.0), (1.0, -1.0, 0.1, 2.1), ("4x8", "4x8"), 1e-6, False),
    ((0.0, -math.inf, -math.inf, math.inf),) * 2 + (("1x4", "1x4"), 0.0, True),  # a mask
    ((math.nan, -1.0, math.nan, math.nan),) * 2 + (("4x8", "4x8"), 0.0, False),
    ((1.0, -1.0, 0.1, 2.0), (1.0, -1.0, 0.1, 2.0), ("4x8", "32"), 0.0, False),
    (None, (1.0, -1.0, 0.1, 2.0), ("4x8", "4x8"), 0.0, False),       # task: tensor
    (None, None, ("0", "0"), 0.0, True),                              # empty: nothing to read
])
def test_statistics_agree_only_when_they_say_the_same_tensor(golden, target, shapes, tolerance,
                                                             agreed):
    from atb_probe.tools.triage import agree
    assert agree(_pair(golden, target, shapes), tolerance) is agreed


def test_a_difference_statistics_hide_is_traced_back_through_the_layers_inputs():
    """Layer 1's output differs element by element with the same statistics (a permutation);
    layer 2's output differs in its statistics too. The triage reads layer 2 first, sees its
    inputs differ, and reads layer 1 at once: the verdict is the full comparison's, and layer
    3 is never read."""
    from atb_probe.layout import Side
    from atb_probe.statcsv import Stats
    from atb_probe.tools.compare import _OpSpan
    from atb_probe.tools.comparison import MatchMethod, PairResult, RefPair, TensorRef, Thresholds
    from atb_probe.tools.divergence import crosses, judge
    from atb_probe.tools.metrics import TensorMetrics
    from atb_probe.tools.triage import triage

    same, moved = Stats(1.0, -1.0, 0.0, 4.0), Stats(1.5, -1.0, 0.1, 5.0)
    hidden = {"1_Layer/output.0", "2_Layer/input.0", "2_Layer/output.0"}   # cross, read
    work, spans = [], []
    for k in range(4):
        indices = []
        for io, n in ((Side.INPUT, 0), (Side.OUTPUT, 1)):
            name = f"{k}_Layer/{io}.0"
            target = moved if name == "2_Layer/output.0" else same
            refs = [TensorRef(name, "0_1", 0, "float", "4x8", stats, f"{name}.bin", 2 * k + n,
                              f"{k}_Layer", io) for stats in (same, target)]
            indices.append(len(work))
            work.append(RefPair(*refs, MatchMethod.ID))
        spans.append(_OpSpan(0, f"{k}_Layer", f"{k}_Layer", indices))
    reads = []

    def read(indices):
        reads.extend(indices)
        out = []
        for i in indices:
            p = work[i]
            row = PairResult(p.golden, p.target, p.match, mode="tensor")
            cos = 0.5 if p.target.data_name in hidden else 1.0
            row.metrics = TensorMetrics(cosine=cos, one_thousandth_ratio=cos)
            out.append(row)
        return out

    def finish(_, row):
        row.diverged = crosses(row, Thresholds())

    full_rows = read(range(len(work)))
    for row in full_rows:
        finish(0, row)
    full = judge(span.rows(full_rows) for span in spans).finding
    assert (full.op_path, full.inputs) == ("1_Layer", "clean")
    reads.clear()
    triaged = triage(work, spans, [], read, finish)
    assert triaged.verdict.finding.summary() == full.summary()
    assert sorted(reads) == [2, 3, 4, 5]     # layers 1 and 2; never 0 nor 3
    assert triaged.report.stopped and triaged.report.units_read == 2
