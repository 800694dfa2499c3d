"""Engine steps (SPEC §8): every root call of one step is one round; a root that calls no
module is its own layer-level op; rounds that wrote nothing are counted apart."""
from __future__ import annotations

import gc
import json

import pytest
import torch
from torch import nn

import atb_probe

from conftest import dump, only_proc, op_dirs, read_csv, tiny_llama
from harness import config, wait_until


class ServingLoop:
    """A hand-written serving loop: an embedding, a decoder and a head called as three roots,
    then a greedy pick, as engines split a step."""

    def __init__(self):
        llama = tiny_llama()
        self.body, self.head = llama.model, llama.lm_head
        self.embed = llama.model.embed_tokens

    def step(self, ids):
        with torch.no_grad():
            hidden = self.body(inputs_embeds=self.embed(ids)).last_hidden_state
            return self.head(hidden)[:, -1].argmax(-1)


@pytest.fixture(scope="module")
def loop():
    return ServingLoop()


IDS = torch.tensor([[1, 2, 3, 4]])


def layer_ops(round_dir):
    return [d for d in op_dirs(round_dir) if "/" not in d]


def test_every_root_of_a_step_is_in_one_round_with_ids_continuing(tmp_path, loop):
    def run():
        for _ in range(2):
            with atb_probe.step():
                loop.step(IDS)

    proc = only_proc(dump(tmp_path, config(), run))
    assert sorted(p.name for p in proc.iterdir()) == ["0", "1"]
    ops = layer_ops(proc / "0")
    assert ops[0] == "0_Embedding" and ops[-1] == f"{len(ops) - 1}_Linear"
    assert ops[-2] == f"{len(ops) - 2}_LlamaRMSNorm"
    rows = read_csv(proc / "0" / "statistic.csv")
    assert {r["Execution Count"] for r in rows} == {"0"}
    assert rows[-1]["Op Id"] == str(len(ops) - 1) and rows[-1]["Input/Output"] == "output"


def test_a_step_inside_a_step_is_part_of_it(tmp_path, loop):
    """An engine step begun inside another (a user's `step()` around an engine's) joins it: the
    inner step's end does not end the round, so the roots after it are in the same round."""
    def run():
        with atb_probe.step():
            with atb_probe.step():
                hidden = loop.body(inputs_embeds=loop.embed(IDS)).last_hidden_state
            loop.head(hidden)

    proc = only_proc(dump(tmp_path, config(), run))
    assert [p.name for p in proc.iterdir()] == ["0"]
    ops = layer_ops(proc / "0")
    assert ops[0] == "0_Embedding" and ops[-1] == f"{len(ops) - 1}_Linear"


def test_without_a_step_each_root_is_a_round_and_a_leaf_root_is_op_0(tmp_path, loop):
    proc = only_proc(dump(tmp_path, config(), lambda: loop.step(IDS)))
    assert sorted(p.name for p in proc.iterdir()) == ["0", "1", "2"]
    assert layer_ops(proc / "0") == ["0_Embedding"]
    assert layer_ops(proc / "2") == ["0_Linear"]
    for index in ("0", "2"):
        rows = read_csv(proc / index / "statistic.csv")
        assert [r["Input/Output"] for r in rows] == ["input", "output"]
        assert all(r["Op Id"] == "0" for r in rows)


def test_exec_range_counts_steps(tmp_path, loop):
    def run():
        for _ in range(3):
            with atb_probe.step():
                loop.step(IDS)

    proc = only_proc(dump(tmp_path, config(exec_range="1,1"), run))
    assert [p.name for p in proc.iterdir()] == ["1"]
    assert layer_ops(proc / "1")[-1].endswith("_Linear")


def test_a_step_is_one_entry_of_its_main_models_file(tmp_path, loop):
    @atb_probe.step(phase="Decoder")
    def decode(ids):
        return loop.step(ids)

    root = dump(tmp_path, config(task="statistics"), lambda: [decode(IDS) for _ in range(3)])
    [model_file] = (root / "info" / "model").glob("*/*.json")
    assert model_file.name == "LlamaModel_Decoder.json"
    doc = json.loads(model_file.read_text())
    assert doc["rounds"] == [[0, 2]]
    assert [n["opType"] for n in doc["nodes"]][0] == "Embedding"
    assert doc["nodes"][-1]["opType"] == "Linear"


def test_a_step_begun_while_the_probe_slept_is_not_a_round(tmp_path, loop):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(config(dump_enable=False)))
    probe = atb_probe.enable(str(tmp_path), str(cfg))
    try:
        with atb_probe.step():
            loop.body(inputs_embeds=loop.embed(IDS))
            cfg.write_text(json.dumps(config()))
            probe.poll_config()
            # awake now, in the middle of the step
            assert getattr(nn.Module.__call__, "__atb_probe__", False)
            loop.head(torch.zeros(1, 4, 32))
        with atb_probe.step():
            loop.step(IDS)
    finally:
        atb_probe.disable(timeout=60)
    proc = only_proc(tmp_path / "atb_dump_data")
    assert [p.name for p in proc.iterdir()] == ["0"]
    assert layer_ops(proc / "0")[0] == "0_Embedding"


def test_rounds_that_wrote_nothing_are_counted_apart(tmp_path, loop):
    probe = atb_probe.enable(str(tmp_path), config(ids="99"))
    try:
        for _ in range(2):
            with atb_probe.step():
                loop.step(IDS)
        status = probe.status()
    finally:
        atb_probe.disable(timeout=60)
    assert status["rounds_dumped"] == 0 and status["rounds_empty"] == 2


def test_a_finished_round_is_in_its_model_file_without_another_round(tmp_path, loop):
    probe = atb_probe.enable(str(tmp_path), config(task="statistics"))
    try:
        for _ in range(2):
            with atb_probe.step(phase="Decoder"):
                loop.step(IDS)
        def rounds_listed():
            files = list((tmp_path / "atb_dump_data" / "info" / "model").glob("*/*.json"))
            return files and json.loads(files[0].read_text())["rounds"] == [[0, 1]]

        wait_until(rounds_listed, 10, "the second step listed in the model file")
        assert probe.status()["model_files_pending"] == 0
    finally:
        atb_probe.disable(timeout=60)


def test_a_phase_other_than_prefill_or_decoder_is_refused():
    with pytest.raises(ValueError):
        atb_probe.step(phase="decode")


def test_a_step_without_a_probe_does_nothing(loop):
    with atb_probe.step():
        assert loop.step(IDS).shape == (1,)


def test_a_root_with_no_submodule_is_its_own_op_with_files(tmp_path):
    linear = nn.Linear(4, 3)
    proc = only_proc(dump(tmp_path, config(), lambda: linear(torch.ones(2, 4))))
    assert op_dirs(proc / "0") == ["0_Linear"]
    assert (proc / "0" / "0_Linear" / "after" / "outtensor0.bin").is_file()
    assert (proc / "0" / "0_Linear" / "before" / "intensor0.bin").is_file()


def test_a_model_dropped_before_the_probe_closes_still_gets_its_last_rounds_listed(tmp_path):
    # An engine frees its model at shutdown, before the probe's exit flush; the rounds that
    # waited for the model file's once-a-second rewrite must still be written.
    def run():
        model = tiny_llama()
        with torch.no_grad():
            for _ in range(3):
                model(IDS)
        del model
        gc.collect()

    proc = only_proc(dump(tmp_path, config(task="statistics"), run))
    files = list((proc.parent.parent / "info" / "model").rglob("*.json"))
    assert len(files) == 1
    assert json.loads(files[0].read_text())["rounds"] == [[0, 2]]
