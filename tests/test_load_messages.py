"""A user's first hour (SPEC §2-§4): when the probe will dump nothing for now, the first thing
it prints says so and what to change."""
from __future__ import annotations

import json

import torch

import atb_probe

from conftest import config, generate, run_loaded, tiny_llama

SCRIPT = "import torch\nprint('ran')\n"


def test_a_mistyped_config_path_is_named_when_the_script_is_sourced(tmp_path):
    result = run_loaded(tmp_path, SCRIPT, load_args=f"--output={tmp_path} --config=confg.json")
    assert result.returncode == 0 and "ran" in result.stdout
    assert f"{tmp_path}/confg.json does not exist (yet)" in result.stderr, result.stderr
    assert f"no config file at {tmp_path}/confg.json yet" in result.stderr, result.stderr


def test_a_config_with_dump_enable_false_says_the_probe_sleeps(tmp_path):
    result = run_loaded(tmp_path, SCRIPT, cfg=config(dump_enable=False))
    assert result.returncode == 0
    assert '"dump_enable": false: the probe sleeps and dumps nothing' in result.stderr


def test_a_config_that_will_dump_says_only_that_it_is_ready(tmp_path):
    result = run_loaded(tmp_path, SCRIPT, cfg=config())
    assert "Ready to dump ATB data" in result.stderr
    assert "dumps nothing" not in result.stderr and "does not exist" not in result.stderr


def test_a_live_edit_to_rounds_that_have_passed_says_nothing_more_is_dumped(tmp_path, capfd):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config(task="statistics", exec_range="none")))
    probe = atb_probe.enable(str(tmp_path), str(path))
    model = tiny_llama()
    with torch.no_grad():
        generate(model, 4, 3)   # rounds 0-2
    path.write_text(json.dumps(config(task="statistics", exec_range="0,1")))
    probe.poll_config()
    atb_probe.disable(timeout=60)
    err = capfd.readouterr().err
    assert 'exec_range "0,1" selects only rounds that have passed (the next round is 3)' in err
