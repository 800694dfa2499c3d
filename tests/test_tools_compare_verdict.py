"""The verdict never guesses: real dumps of a tiny Llama where some op's tensors cannot be
compared (a layer whose output has another shape, a layer only one side dumped), with and
without a planted fault in that layer."""
from __future__ import annotations

import json

import pytest
import torch

from atb_probe import cli
from atb_probe.tools.compare import compare_dumps, write_outputs
from atb_probe.tools.divergence import InputState

from conftest import dump, generate, tiny_llama
from harness import config
from test_tools_report_browser import BROWSER, pixels, screenshot

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
def flat_broken_dump(tmp_path_factory):
    return llama_dump(tmp_path_factory, "flat_broken", flat=True, broken=True)


@pytest.fixture(scope="module")
def flat_dump(tmp_path_factory):
    return llama_dump(tmp_path_factory, "flat", flat=True)


@pytest.fixture(scope="module")
def golden_ids(tmp_path_factory):
    """The golden run dumped with `ids` that leave out the layer the target perturbs."""
    return llama_dump(tmp_path_factory, "golden_ids", ids="0,1,2,4,5,6,7")


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    return llama_dump(tmp_path_factory, "broken", broken=True)


@pytest.fixture(scope="module")
def flat_broken(golden, flat_broken_dump):
    return compare_dumps(str(golden), str(flat_broken_dump))


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
        golden, flat_dump):
    result = compare_dumps(str(golden), str(flat_dump))
    assert result.finding is None
    assert [u.op_path for u in result.unjudged] == [FLAT]
    text = result.verdict_text()
    assert text.startswith("no divergence") and "1 paired op could not be judged" in text
    assert FLAT in text and "shape differs" in text


def test_a_judged_child_of_the_unjudged_layer_is_still_the_first_divergence(tmp_path_factory):
    good = llama_dump(tmp_path_factory, "golden_children", save_child=True)
    bad = llama_dump(tmp_path_factory, "flat_broken_children", flat=True, broken=True,
                     save_child=True)
    f = compare_dumps(str(good), str(bad)).finding
    assert f.inputs_clean and f.op_path == DOWN_PROJ


def test_a_layer_the_golden_did_not_dump_is_where_the_error_may_start(golden_ids, broken):
    good, bad = golden_ids, broken
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


def read_summary(out) -> dict:
    def strict(word):
        raise ValueError(f"not strict JSON: {word}")
    return json.loads((out / "atb_compare_summary.json").read_text(), parse_constant=strict)


def test_the_json_summary_and_the_exit_status_for_ci(golden, flat_broken_dump, flat_dump,
                                                      tmp_path, capsys):
    out = tmp_path / "broken"
    args = ["compare", str(golden), str(flat_broken_dump), "-o", str(out), "--no-xlsx",
            "--no-html"]
    assert cli.main(args) == 0                     # a finding is not a failure by default
    assert cli.main(args + ["--fail-on-divergence"]) == 1
    printed = capsys.readouterr().out
    doc = read_summary(out)
    assert doc["diverged"] is True and doc["verdict"] in printed.replace("\n", "")
    first = doc["first_divergence"]
    assert first["inputs"] == "unknown" and first["metric"] in ("cosine", "one_thousandth_ratio")
    assert first["value"] == first["metrics"][first["metric"]] < 0.99
    for side in ("golden", "target"):
        assert first[side]["op_path"] == NEXT and first[side]["op_name"] == "LlamaDecoderLayer"
        assert first[side]["round"] == 0 and first[side]["tensor"] == f"{NEXT}/output.0"
    assert first["request"] is None and first["token"] is None
    assert first["unknown_input"]["tensor"] == f"{NEXT}/input.0"
    assert first["unknown_input"]["why"].startswith("shape differs")
    assert first["unjudged_before"]["target_op_path"] == FLAT
    assert doc["counts"]["unjudged_ops"] == 1 and doc["counts"]["crossing"] > 0
    assert doc["thresholds"] == {"min_cosine": 0.99, "min_ratio": 0.9, "max_norm_err": 1.0}
    assert doc["rounds"] == [{"golden": 0, "target": 0}] and doc["unmatched"] == []

    out = tmp_path / "clean"
    assert cli.main(["compare", str(golden), str(flat_dump), "-o", str(out), "--no-xlsx",
                     "--no-html", "--fail-on-divergence"]) == 0
    doc = read_summary(out)
    assert doc["diverged"] is False and doc["first_divergence"] is None
    assert [u["target_op_path"] for u in doc["unjudged"]] == [FLAT]


def test_the_summary_groups_what_could_not_be_aligned(golden_ids, broken, tmp_path):
    out = tmp_path / "c"
    assert cli.main(["compare", str(golden_ids), str(broken), "-o", str(out), "--no-xlsx",
                     "--no-html", "--fail-on-divergence"]) == 1
    doc = read_summary(out)
    assert doc["first_divergence"]["inputs"] == "crossing"
    [group] = doc["unmatched"]
    assert (group["only_in"], group["kind"], group["what"]) == ("target", "op", [FLAT])
    assert group["entries"] == 1 and "no op of the other dump pairs with it" in group["why"]


WARN_BOX = (255, 246, 221)           # div.warn background: a verdict that is not clean
CLEAN_BOX = (253, 232, 232)          # div.bad background: a clean first divergence
CAVEAT = (138, 90, 0)                # .caveat text and the ? of an output without metrics


def test_the_report_shows_the_alignment_and_the_caveat(flat_broken, tmp_path):
    write_outputs(flat_broken, str(tmp_path), xlsx=False)
    page = (tmp_path / "atb_compare_report.html").read_text()
    alignment = page[page.index("<h2>Alignment</h2>"):page.index("<h2>Per layer")]
    assert "<td>0_" in alignment and "ops by id" in alignment and "without metrics" in alignment
    judged = alignment[alignment.index("Ops that could not be judged"):]
    assert f"<code>{FLAT}</code>" in judged and "shape differs" in judged
    assert "<h3>Unmatched</h3><p>Everything was matched." in alignment
    box = page[page.index("<div class='warn'>"):page.index("<h2>Summary")]
    assert "an input could not be compared" in box
    assert "<div class='caveat'>its input input.0 could not be compared" in box
    assert page.count("class='unk'") == 1          # the flattened layer's output in the plot
    if BROWSER is None:
        pytest.skip("no headless Chromium installed to look at it")
    image = screenshot(tmp_path / "atb_compare_report.html", tmp_path)
    warn = pixels(image, WARN_BOX)
    assert len(warn) > 20_000 and warn[:, 0].min() < 150      # a wide box at the top
    assert len(pixels(image, CLEAN_BOX)) == 0                  # not drawn as a clean finding
    caveat = pixels(image, CAVEAT)
    inside = caveat[(caveat[:, 0] > warn[:, 0].min()) & (caveat[:, 0] < warn[:, 0].max())]
    assert len(inside) > 50                                    # the caveat line, in the box
