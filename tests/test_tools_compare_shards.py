"""`atb-probe compare` of a tensor-parallel run against one process (SPEC §9, "Shards").

The same checkpoint (a tiny Llama saved with `save_pretrained`) runs through
`examples/tensor_parallel/tp_auto.py` under real `torchrun`: split over 2 ranks by
`transformers` (`tp_plan="auto"`, gloo on CPU) and whole on 1 rank, the probe loaded from the
shell. The 2 ranks are one side of the comparison: their pieces of each tensor are concatenated,
summed (a row-parallel layer's partial results) or taken once (replicated) before the metrics.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from atb_probe.statcsv import Stats
from atb_probe.tools.compare import compare_dumps
from atb_probe.tools.comparison import CompareMode, Join, PairMode, Pieces
from atb_probe.tools.shards import (Decision, Region, _fused_decision, _per_part, decide,
                                    joined_note, joined_stats, load_joined)

from conftest import tiny_llama
from harness import cli, config, torchrun_loaded

pytest.importorskip("accelerate", reason="transformers needs accelerate for tp_plan")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tensor_parallel" / "tp_auto.py"
# The layer-level ops but the lm_head: embedding, rotary embedding, 2 decoder layers, norm.
DUMPED = config(task="all", save_child=True, exec_range="all", ids="0,1,2,3,4")
FAULTY_LAYER = "3_LlamaDecoderLayer"      # model.layers.1, whose down_proj is perturbed


# -- how pieces join, decided from data (no torch) ----------------------------------------------

def test_shapes_that_add_up_along_one_dimension_are_concatenated_there():
    assert decide([(1, 2, 6, 8), (1, 2, 6, 8)], (1, 4, 6, 8), None, Region.OUTSIDE) == \
        Decision(Join.CONCAT, 1, "rank shapes add up to the golden's")
    assert decide([(6, 16), (6, 17)], (6, 33), None, Region.OUTSIDE).dim == 1


def test_the_golden_shape_on_every_rank_is_replicated_outside_a_row_parallel_layer():
    assert decide([(1, 6, 32)] * 2, (1, 6, 32), None, Region.OUTSIDE).join == Join.REPLICATED
    assert decide([(1, 6, 32)] * 2, (1, 6, 32), None, Region.REDUCED).join == Join.REPLICATED
    assert decide([(6, 32)] * 2, (6, 32), None, Region.PARTIAL, "o_proj").join == Join.SUM


def test_a_dtensor_placement_decides_before_the_shapes():
    assert decide([(16, 32)] * 2, (32, 32), "Shard(dim=0)", Region.OUTSIDE) == \
        Decision(Join.CONCAT, 0, "DTensor Shard(dim=0)")
    assert decide([(1, 6, 32)] * 2, (1, 6, 32), "Partial(sum)", Region.OUTSIDE).join == Join.SUM
    masked = decide([(1, 6, 32)] * 2, (1, 6, 32),
                    "_MaskPartial(reduce_op=sum, offset_shape=torch.Size([64, 32]), offset_dim=0)",
                    Region.OUTSIDE)
    assert masked.join is None and "masked" in masked.reason


def test_what_nothing_decides_is_left_undecided_with_the_reason():
    odd = decide([(1, 6, 16), (1, 6, 16)], (1, 7, 32), None, Region.OUTSIDE)
    assert odd.join is None and "1x6x16, 1x6x16" in odd.reason and "1x7x32" in odd.reason
    unknown = decide([(6, 32)] * 2, (6, 32), None, Region.UNKNOWN, "o_proj")
    assert unknown.join is None and "not dumped" in unknown.reason


def test_a_fused_modules_pieces_split_into_their_parts():
    # vLLM's merged gate and up projections over 2 ranks: half of each part on each rank.
    assert _per_part(2, 256, [256, 256]) == ((128, 1), (128, 1))
    # q, k, v with one key/value head over 2 ranks: q split, k and v whole on each rank.
    assert _per_part(2, 192, [128, 64, 64]) == ((64, 1), (64, 2), (64, 2))
    # 8 ranks, 4 key/value heads of 16: each head on 2 consecutive ranks.
    assert _per_part(8, 64, [256, 64, 64]) == ((32, 1), (16, 2), (16, 2))
    assert _per_part(2, 100, [128, 64, 64]) is None          # no such split
    # The rank shapes do not add up to the golden's, yet every other dimension is its.
    assert _fused_decision([(7, 192)] * 2, (7, 256), -1, [128, 64, 64]) == \
        Decision(Join.CONCAT, 1, "rank pieces of a fused module")


def test_fused_pieces_join_part_by_part(tmp_path):
    import numpy as np

    from atb_probe.binfile import encode_header
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((3, n)).astype(np.float32) for n in (128, 64, 64))
    paths = []
    for rank in range(2):   # each rank: its half of q, then all of k and v
        piece = np.ascontiguousarray(np.concatenate([q[:, rank * 64:(rank + 1) * 64], k, v], 1))
        path = tmp_path / f"rank{rank}.bin"
        path.write_bytes(encode_header(0, piece.shape, piece.nbytes) + piece.tobytes())
        paths.append(str(path))
    pieces = Pieces(Join.CONCAT, 1, tuple(paths), "", _per_part(2, 192, [128, 64, 64]))
    whole, note = load_joined(pieces)
    assert note == "" and np.array_equal(whole, np.concatenate([q, k, v], 1))


def test_statistics_of_slices_join_and_those_of_partial_sums_do_not():
    a, b = Stats(2.0, -1.0, 0.5, 3.0), Stats(1.0, -4.0, -0.5, 4.0)
    whole = joined_stats(Join.CONCAT, [a, b], [(2, 3), (2, 1)])
    assert whole == Stats(2.0, -4.0, (0.5 * 6 - 0.5 * 2) / 8, 5.0)
    assert joined_stats(Join.REPLICATED, [a, b], [(2, 3)] * 2) == a
    assert joined_stats(Join.SUM, [a, b], [(2, 3)] * 2) is None
    assert "statistics cannot be joined" in joined_note(Pieces(Join.SUM, 0, (None, None), ""))
    assert joined_note(Pieces(Join.SUM, 0, ("0.bin", "1.bin"), "")) == ""   # the data is summed


# -- real ranks -----------------------------------------------------------------------------

def _checkpoint(folder: Path, faulty: bool) -> Path:
    model = tiny_llama(layers=2)
    if faulty:
        with torch.no_grad():
            weight = model.model.layers[1].mlp.down_proj.weight
            weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(1))
                        * 0.05)
    model.save_pretrained(folder)
    return folder


def _dump(tmp_path_factory, name: str, ranks: int, faulty: bool = False) -> Path:
    """Generate on `ranks` torchrun ranks under the probe; the dump root."""
    tmp = tmp_path_factory.mktemp(name)
    checkpoint = _checkpoint(tmp / "checkpoint", faulty)
    stdout = torchrun_loaded(tmp, DUMPED, EXAMPLE, str(checkpoint), ranks=ranks)
    # Not anchored to a line: the ranks' lines may interleave.
    assert len(re.findall(r"rank \d/\d local_rank", stdout)) == ranks, stdout
    return tmp / "atb_dump_data"


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    return _dump(tmp_path_factory, "one_rank", 1)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _dump(tmp_path_factory, "two_ranks", 2)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    return _dump(tmp_path_factory, "two_ranks_faulty", 2, faulty=True)


@pytest.fixture(scope="module")
def tensors(golden, two_ranks):
    return compare_dumps(str(golden), str(two_ranks), CompareMode.TENSOR)


def module_path(ref) -> str:
    """The module path of the op a compared tensor belongs to (a kernel: of its module)."""
    folder = Path(ref.path).parent.parent
    for op in (folder, folder.parent):
        param = json.loads((op / "op_param.json").read_text())
        if "modulePath" in param:
            return param["modulePath"]
    return ""


def rows_of(result, module: str, name: str):
    """The rows of tensors `name` (a regex on the target's name) in modules ending in `module`."""
    return [r for r in result.rows if r.target.path and module_path(r.golden).endswith(module)
            and re.search(name, r.name)]


def test_two_ranks_are_one_side_against_one_rank(tensors):
    assert tensors.ranks is not None and tensors.ranks.ranks == 2
    assert ("target ranks", "2 ranks joined (tensor parallel)") in tensors.summary_lines()
    assert not [u for u in tensors.unmatched if u.kind == "process"]
    assert {r.target.process for r in tensors.rows} == {tensors.rows[0].target.process}
    assert tensors.finding is None, tensors.finding.summary()


def test_row_parallel_outputs_are_summed_and_compared_with_metrics(tensors):
    for module in ("self_attn.o_proj", "mlp.down_proj"):
        partial = rows_of(tensors, module, r"MmKernel/output\.0$")
        reduced = rows_of(tensors, module, r"_Linear/output\.0$")
        assert len(partial) == len(reduced) == 2 * 2, module    # 2 layers, 2 rounds
        for row in partial:
            assert row.target.pieces.join == Join.SUM, row.name
        for row in reduced:
            assert row.target.pieces.join == Join.REPLICATED, row.name
        for row in partial + reduced:
            assert row.mode == PairMode.TENSOR and row.metrics.cosine > 0.9999, row.name
            assert row.target.shape == row.golden.shape and not row.note, row.name


def test_column_parallel_outputs_are_concatenated(tensors):
    rows = rows_of(tensors, "self_attn.q_proj", r"_Linear/output\.0$")
    assert len(rows) == 4
    for row in rows:
        assert row.target.pieces.join == Join.CONCAT and row.target.pieces.dim == 2
        assert row.target.shape == row.golden.shape
        assert row.mode == PairMode.TENSOR and row.metrics.cosine > 0.9999, row.name


def test_almost_every_tensor_is_compared_element_by_element(tensors):
    with_data = [r for r in tensors.rows if r.target.path]
    assert sum(r.mode == PairMode.TENSOR for r in with_data) >= 0.95 * len(with_data)


def test_tensors_whose_pieces_cannot_be_joined_are_listed_and_not_compared(tensors):
    undecided = {u.name.split("/", 2)[2]: u.reason for u in tensors.ranks.undecided}
    assert any(name.endswith("EmbeddingKernel/output.0") and "masked" in reason
               for name, reason in undecided.items()), undecided
    for row in tensors.rows:
        if row.target.pieces is not None and row.target.pieces.join is None:
            assert row.mode == PairMode.NO_DATA and row.diverged is None
            assert row.note.startswith("target: ranks not joined: "), row.note


def test_statistics_of_the_ranks_are_joined(golden, two_ranks):
    """Slices' statistics join from the csv; a partial sum's come from the summed data (the
    statistics of a row-parallel layer's output are those after its all-reduce)."""
    result = compare_dumps(str(golden), str(two_ranks), CompareMode.STATISTICS)
    assert result.finding is None, result.finding.summary()
    rows = [row for module, name in (("mlp.down_proj", r"MmKernel/output\.0$"),
                                     ("mlp.down_proj", r"_Linear/output\.0$"),
                                     ("self_attn.q_proj", r"_Linear/output\.0$"))
            for row in rows_of(result, module, name)]
    assert len(rows) == 3 * 4
    for row in rows:
        assert row.mode == PairMode.STATISTICS and abs(row.diffs.norm_rel_pct) < 0.01, row.name


def test_a_perturbed_layer_of_the_two_rank_run_is_named(golden, faulty):
    # In worker processes, several batches: the joined refs travel to them.
    result = compare_dumps(str(golden), str(faulty), CompareMode.TENSOR, jobs=2,
                           batch_elements=1 << 12)
    assert result.finding is not None
    assert result.finding.op_path.startswith(FAULTY_LAYER + "/4_LlamaMLP/"), \
        result.finding.summary()
    assert result.finding.inputs_clean
    assert module_path(next(r.golden for r in result.rows
                            if r.op_path == result.finding.op_path)) == \
        "model.layers.1.mlp.down_proj"


def test_ranks_that_ran_different_ops_are_not_joined(golden, two_ranks, tmp_path):
    """Pipeline stages: rank 1 ran other layers than rank 0. The processes are paired by device,
    as before, and rank 1 is left unmatched."""
    stages = tmp_path / "atb_dump_data"
    shutil.copytree(two_ranks, stages)
    rank1 = next(p for p in (stages / "data").iterdir() if p.name.startswith("1_"))
    for csv in rank1.glob("*/statistic.csv"):
        lines = csv.read_text().splitlines(keepends=True)
        csv.write_text("".join(line for line in lines if ",3_" not in line and ",3," not in line))
    result = compare_dumps(str(golden), str(stages), CompareMode.TENSOR)
    assert result.ranks is None
    assert [u.what for u in result.unmatched if u.kind == "process"] == \
        [f"process {rank1.name}"]


def test_the_command_says_the_ranks_were_joined(golden, two_ranks, tmp_path):
    result = cli("compare", golden, two_ranks, "-o", tmp_path / "out", "--no-xlsx")
    assert result.returncode == 0, result.stderr
    assert "target: 2 ranks joined (tensor parallel)" in result.stdout
    assert "could not be joined" in result.stdout and "EmbeddingKernel" in result.stdout
    assert "no divergence" in result.stdout
    joined = json.loads((tmp_path / "out" / "atb_compare_summary.json").read_text())
    assert joined["ranks_joined"]["side"] == "target" and joined["ranks_joined"]["ranks"] == 2
    assert any(u["tensor"].endswith("EmbeddingKernel/output.0") and "masked" in u["why"]
               for u in joined["ranks_joined"]["not_joined"])
