"""`atb-probe compare GOLDEN TARGET --replay`: compare's first divergence, then replay's culprit
search from there, its verdict in the console, `atb_compare_summary.json` and the HTML report.
Real dumps of a tiny Llama: one whose `aten::mm` is wrong for one call of one layer (its CPU
kernel overridden through `torch.library`), its clean fp32 golden, and a second clean run."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import Root, dump
from harness import cli, config, run_loaded
from test_tools_replay import CULPRIT, CULPRIT_ID, LLAMA, Noisy, llama_run

DOCS = Path(__file__).resolve().parent.parent / "docs" / "analysis.md"


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    return llama_run(tmp_path_factory, "golden")


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    return llama_run(tmp_path_factory, "faulty", fault=True)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return llama_run(tmp_path_factory, "clean")


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory):
    """The golden's model with layer 1's down_proj weight made 50% larger."""
    tmp = tmp_path_factory.mktemp("perturbed")
    script = LLAMA.format(fault="", dtype="float32").replace(
        ".eval()\n", ".eval()\nmodel.model.layers[1].mlp.down_proj.weight.data.mul_(1.5)\n")
    result = run_loaded(tmp, script, config(task="tensor", save_child=True))
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr
    return tmp


def compare(golden, target, out: Path, *args):
    result = cli("compare", str(golden), str(target), "-o", str(out), "--no-xlsx", "-j", "1",
                 *args)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "atb_compare_summary.json").read_text())
    return result, summary, (out / "atb_compare_report.html").read_text()


@pytest.fixture(scope="module")
def faulty_compared(golden, faulty, tmp_path_factory):
    return compare(golden, faulty, tmp_path_factory.mktemp("cmp") / "out", "--replay")


def test_replay_names_the_planted_kernel_as_introduced(faulty_compared):
    result, summary, _ = faulty_compared
    replay = summary["replay"]
    assert replay["verdict"] == "introduced here"
    kernel = replay["kernel"]
    assert (kernel["op_id"], kernel["op_path"]) == (CULPRIT_ID, CULPRIT)
    assert (kernel["op"], kernel["op_name"]) == ("aten.mm.default", "MmKernel")
    out = kernel["outputs"][0]
    assert out["introduced"] is True and out["error"] > out["bound"]
    assert 0.09 < out["metrics"]["max_rel_err"] < 0.11      # the planted 10%
    assert not any(i["crossing"] for i in kernel["inherited"])
    assert replay["bound"]["margin"] == 4 and replay["bound"]["ulps"] == 2
    # The search began at compare's first divergence, which holds the culprit.
    assert summary["diverged"] is True
    start = replay["started_from"]
    assert CULPRIT.startswith(start["target_op_path"] + "/") or start["target_op_path"] == CULPRIT
    assert replay["verdicts"]["introduced here"] == 1
    line = next(x for x in result.stdout.splitlines() if x.startswith("replay: culprit:"))
    assert f"introduced here: round 0, {CULPRIT_ID} ({CULPRIT}) aten.mm.default" in line


def test_the_report_shows_the_culprit(faulty_compared):
    _, _, html = faulty_compared
    box = re.search(r"<div class='bad replay'><div class='big'>Replay: (.*?)</div></div>", html,
                    re.S)
    assert box, "the report has no replay box"
    text = box.group(1)
    assert f"<code>{CULPRIT_ID}</code>" in text and "aten.mm.default" in text
    assert CULPRIT in text and "introduced here" in text


def test_a_clean_pair_has_no_culprit(golden, clean, tmp_path):
    result, summary, html = compare(golden, clean, tmp_path / "out", "--replay")
    replay = summary["replay"]
    assert summary["diverged"] is False
    assert replay["verdict"] == "within its dtype" and replay["kernel"] is None
    assert replay["started_from"] is None and replay["kernels"] > 50
    assert replay["verdicts"]["introduced here"] == 0
    assert "replay: no culprit" in result.stdout
    assert "Replay: no kernel introduced error beyond its dtype" in html


def test_a_changed_weight_is_inherited_by_the_kernels_not_introduced(golden, perturbed,
                                                                      tmp_path):
    result, summary, html = compare(golden, perturbed, tmp_path / "out", "--replay")
    replay = summary["replay"]
    assert summary["first_divergence"]["target"]["op_path"].startswith(
        "3_LlamaDecoderLayer/4_LlamaMLP/")
    assert replay["verdict"] == "inherited" and replay["verdicts"]["introduced here"] == 0
    kernel = replay["kernel"]
    # The first kernel handed the changed weight: its transpose, which computed it exactly.
    assert kernel["op"] == "aten.t.default"
    assert kernel["op_path"].startswith("3_LlamaDecoderLayer/4_LlamaMLP/")
    assert kernel["carrier"].startswith("intensor0 (self)")
    assert any(line.startswith("replay: no kernel introduced error") for line in
               result.stdout.splitlines())
    assert "Replay: no kernel introduced error; the first to differ from the golden " \
           "inherited it" in html


def test_without_replay_the_summary_and_report_have_no_verdict(golden, faulty, tmp_path):
    result, summary, html = compare(golden, faulty, tmp_path / "out")
    assert "replay" not in summary
    assert "Replay:" not in html and "replay:" not in result.stdout


def test_a_statistics_dump_says_why_no_kernel_was_replayed(tmp_path):
    def run(seed):
        torch.manual_seed(seed)
        return lambda: Root(Noisy())(torch.ones(4, 8))

    settings = config(task="statistics", save_child=True)
    g = dump(tmp_path / "g", settings, run(0))
    t = dump(tmp_path / "t", settings, run(0))
    result, summary, html = compare(g, t, tmp_path / "out", "--replay")
    replay = summary["replay"]
    assert replay["verdict"] == "not replayed" and replay["kernel"] is None
    assert "no op_param.json" in replay["why"] and "task statistics" in replay["why"]
    assert replay["not_replayed"][0]["reason"] == "no op_param.json"
    assert "replay: no kernel could be replayed" in result.stdout
    assert "Replay: no kernel could be replayed" in html


def _keys(value) -> set[str]:
    if isinstance(value, dict):
        return set(value).union(*(_keys(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_keys(v) for v in value))
    return set()


def test_every_key_of_the_summary_is_named_in_the_docs(faulty_compared):
    _, summary, _ = faulty_compared
    text = re.sub(r"```.*?```", "", DOCS.read_text(), flags=re.S)
    named = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        named.update(w.strip() for w in span.split(","))
        named.add(span)
    assert _keys(summary) - named == set()
