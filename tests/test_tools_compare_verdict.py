"""The verdict never guesses: real dumps of a tiny Llama where some op's tensors cannot be
compared (a layer whose output has another shape, a layer only one side dumped), with and
without a planted fault in that layer."""
from __future__ import annotations

import torch

from atb_probe.tools.compare import compare_dumps
from atb_probe.tools.divergence import InputState

from conftest import dump, generate, tiny_llama
from harness import config
import pytest

FLAT = "3_LlamaDecoderLayer"         # layers[1]: its output is (tokens, hidden) in the target
NEXT = "4_LlamaDecoderLayer"         # layers[2]: takes that back
DOWN_PROJ = f"{FLAT}/4_LlamaMLP/4_Linear"        # mlp.down_proj
NEVER = ("its inputs match", "before the first dumped op")


def flatten_output(model, k: int):
    """Layer k returns (tokens, hidden) instead of (1, tokens, hidden), layer k+1 adds the batch
    dimension back: the same computation, with one layer's output of another shape (as two
    implementations lay out one tensor), so that layer's rows have no metrics."""
    layers = model.model.layers
    first, second = layers[k].forward, layers[k + 1].forward
    layers[k].forward = lambda h, *args, **kw: first(h, *args, **kw)[0]
    layers[k + 1].forward = lambda h, *args, **kw: second(h.unsqueeze(0), *args, **kw)
    return model


def perturb_mlp(model, k: int):
    """A small change of layer k's MLP: the generated tokens stay the same."""
    with torch.no_grad():
        model.model.layers[k].mlp.down_proj.weight.mul_(1.05)
    return model


def llama_dump(tmp_path_factory, name, flat=False, broken=False, **cfg):
    model = tiny_llama(layers=4)
    if flat:
        flatten_output(model, 1)
    if broken:
        perturb_mlp(model, 1)
    settings = dict(task="tensor", exec_range="0,0")
    settings.update(cfg)
    tmp = tmp_path_factory.mktemp(name)
    return dump(tmp, config(**settings), lambda: generate(model, prompt_len=4, new_tokens=1))


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    return llama_dump(tmp_path_factory, "golden")


@pytest.fixture(scope="module")
def flat_broken(golden, tmp_path_factory):
    return compare_dumps(str(golden), str(llama_dump(tmp_path_factory, "flat_broken",
                                                     flat=True, broken=True)))


def test_a_crossing_op_whose_input_has_no_metrics_is_not_called_clean(flat_broken):
    f = flat_broken.finding
    assert f is not None and f.op_path == NEXT
    assert f.inputs == InputState.UNKNOWN and not f.inputs_clean
    assert f.unknown_input.name == f"{NEXT}/input.0"
    # The perturbed layer had no metrics: it is named, not taken as "did not cross".
    assert f.unjudged is not None and f.unjudged.op_path == FLAT
    text = f.summary()
    assert "its input input.0 could not be compared (shape differs: golden (1, 4, 32), " \
           "target (4, 32))" in text
    assert f"at or before round 0, {FLAT}, whose outputs could not be compared" in text
    assert not any(words in text for words in NEVER)
    assert [u.op_path for u in flat_broken.unjudged] == [FLAT]


def test_without_the_fault_there_is_no_divergence_but_the_unjudged_layer_is_named(
        golden, tmp_path_factory):
    result = compare_dumps(str(golden), str(llama_dump(tmp_path_factory, "flat", flat=True)))
    assert result.finding is None
    assert [u.op_path for u in result.unjudged] == [FLAT]
    text = result.verdict_text()
    assert text.startswith("no divergence") and "1 op could not be judged" in text
    assert FLAT in text and "shape differs" in text


def test_a_judged_child_of_the_unjudged_layer_is_still_the_first_divergence(tmp_path_factory):
    good = llama_dump(tmp_path_factory, "golden_children", save_child=True)
    bad = llama_dump(tmp_path_factory, "flat_broken_children", flat=True, broken=True,
                     save_child=True)
    f = compare_dumps(str(good), str(bad)).finding
    assert f.inputs_clean and f.op_path == DOWN_PROJ


def test_a_layer_the_golden_did_not_dump_is_where_the_error_may_start(tmp_path_factory):
    """The golden run was dumped with `ids` that leave out the layer the target perturbed."""
    good = llama_dump(tmp_path_factory, "golden_ids", ids="0,1,2,4,5,6,7")
    bad = llama_dump(tmp_path_factory, "broken", broken=True)
    result = compare_dumps(str(good), str(bad))
    f = result.finding
    assert f.op_path == NEXT and f.inputs == InputState.CROSSING
    assert f.unjudged.op_path == FLAT and f.unjudged.why == "the golden run has no counterpart"
    assert f"its inputs already differ: the error may start at or before round 0, {FLAT}" \
        in f.summary()
    assert not any(words in f.summary() for words in NEVER)
    # The other way round, the layer is the golden's only: nothing to place it by, but the
    # verdict does not blame the first dumped op either.
    text = compare_dumps(str(bad), str(good)).verdict_text()
    assert "not dumped or not paired" in text and not any(words in text for words in NEVER)
