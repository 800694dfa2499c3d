"""Selections that match nothing (SPEC §7): a warning names the keys and what the round had; a
`device` list that leaves a process out shows in its status and in `atb-probe status`."""
from __future__ import annotations

import torch

import atb_probe
from conftest import dump, generate, tiny_llama
from harness import cli, config, status_docs, wait_until


def test_ids_naming_no_op_warn_once_with_what_the_round_had(tmp_path, capfd):
    model = tiny_llama()
    root = dump(tmp_path, config(exec_range="all", ids="9,2_77"),
                lambda: generate(model, 4, 2))
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "matched no op" in line]
    assert len(warnings) == 1, err
    assert 'ids "9,2_77"' in warnings[0]
    assert "round 0 of LlamaForCausalLM" in warnings[0]
    assert "layer-level op IDs 0..5: Embedding, LlamaRotaryEmbedding, LlamaDecoderLayer, " \
           "LlamaRMSNorm, Linear" in warnings[0]
    assert not list((root / "data").rglob("*.bin"))


def test_op_name_matching_nothing_warns(tmp_path, capfd):
    model = tiny_llama()
    dump(tmp_path, config(op_name="NoSuchOp"), lambda: generate(model, 4, 1))
    err = capfd.readouterr().err
    assert 'op_name "nosuchop" matched no op in round 0' in err


def test_a_selection_that_matches_warns_nothing(tmp_path, capfd):
    model = tiny_llama()
    dump(tmp_path, config(exec_range="all", ids="2_1_0", save_child=False),
         lambda: generate(model, 4, 2))
    assert "matched no op" not in capfd.readouterr().err


def test_each_new_configuration_that_matches_nothing_warns_again(tmp_path, capfd):
    model = tiny_llama()
    for ids in ("40", "41"):
        dump(tmp_path / ids, config(ids=ids), lambda: generate(model, 4, 1))
    err = capfd.readouterr().err
    assert err.count("matched no op") == 2


def test_device_list_that_leaves_the_process_out_shows_in_status(tmp_path, capfd):
    model = tiny_llama()
    atb_probe.enable(str(tmp_path), config(device="7"))
    try:
        with torch.no_grad():
            generate(model, 4, 1)
        wait_until(lambda: [d for d in status_docs(tmp_path / "atb_dump_data")
                            if d["rounds_started"] >= 1 and d["device_selected"] is False],
                   10, "the status file to show the process left out")
        result = cli("status", tmp_path)
    finally:
        atb_probe.disable(timeout=60)
    assert result.returncode == 0, result.stderr
    assert "not selected: device 0 is not in the config's device list" in result.stdout
    assert "WARNING: no live process is selected" in result.stdout
    assert not (tmp_path / "atb_dump_data" / "data").exists() or \
        not list((tmp_path / "atb_dump_data" / "data").rglob("*.bin"))


def test_a_process_the_device_list_leaves_out_says_so_at_load_and_after_exit(tmp_path, capfd):
    atb_probe.enable(str(tmp_path), config(device="7"))
    err = capfd.readouterr().err
    with torch.no_grad():
        generate(tiny_llama(), 4, 1)
    atb_probe.disable(timeout=60)
    assert "(device 0) is not in the config's device list (7): it dumps nothing" in err, err
    assert "Ready to dump" not in err
    result = cli("status", tmp_path)
    assert "exited" in result.stdout
    assert "not selected: device 0 is not in the config's device list, so it dumped nothing" \
        in result.stdout, result.stdout


def test_status_does_not_warn_when_a_process_is_selected(tmp_path):
    model = tiny_llama()
    atb_probe.enable(str(tmp_path), config(device="0"))
    try:
        with torch.no_grad():
            generate(model, 4, 1)
        result = cli("status", tmp_path)
    finally:
        atb_probe.disable(timeout=60)
    assert "no live process is selected" not in result.stdout
