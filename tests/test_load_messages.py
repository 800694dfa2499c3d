"""A user's first hour (SPEC §2-§4): when the probe will dump nothing for now, the first thing
it prints says so and what to change."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import atb_probe

from conftest import generate, tiny_llama
from harness import cli, config, run, run_loaded, status_of

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


def test_an_output_that_is_a_file_gets_one_clear_error_and_an_inert_probe(tmp_path, capfd):
    target = tmp_path / "a-file"
    target.write_text("not a folder")
    atb_probe.enable(str(target), config())
    with torch.no_grad():
        torch.nn.Linear(2, 2)(torch.ones(2))
    atb_probe.disable(timeout=60)
    err = capfd.readouterr().err
    assert f"output {target} is not a folder" in err and "Errno" not in err, err
    assert "Ready to dump" not in err and target.read_text() == "not a folder"


def test_the_final_status_says_exited_not_dumping(tmp_path):
    atb_probe.enable(str(tmp_path), config())
    atb_probe.disable(timeout=60)
    doc = status_of(tmp_path / "atb_dump_data")
    assert doc["exited"] is True and doc["state"] == "exited"


def test_the_help_shows_the_load_command_whole_on_one_line():
    shown = cli("--help", timeout=60)
    line = 'source "$(atb-probe where)/load_atb_probe.sh" --output=$PWD --config=$PWD/config.json'
    assert any(row.strip() == line for row in shown.stdout.splitlines()), shown.stdout


def test_the_demo_folder_is_ignored_by_git_in_a_clone():
    repo = Path(__file__).resolve().parent.parent
    if shutil.which("git") is None or not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    for made in ("atb-probe-demo/", ".venv-engines/", ".venv-msprobe/"):
        ignored = run(["git", "check-ignore", "-q", made], cwd=repo, timeout=60)
        assert ignored.returncode == 0, f"{made} would show as untracked"


def run_cli_run(tmp_path, *args):
    script = tmp_path / "model.py"
    script.write_text(SCRIPT)
    return cli("run", f"--output={tmp_path}", *args, "--", sys.executable, script,
               cwd=tmp_path, timeout=120)


def test_atb_probe_run_without_config_says_the_bundled_one_dumps_nothing(tmp_path):
    result = run_cli_run(tmp_path)
    assert result.returncode == 0 and "ran" in result.stdout
    assert 'config.json has "dump_enable": false: the probe sleeps and dumps nothing' in \
        result.stderr, result.stderr


def test_atb_probe_run_with_a_config_that_does_not_exist_says_so(tmp_path):
    result = run_cli_run(tmp_path, f"--config={tmp_path}/nope.json")
    assert result.returncode == 0
    assert f"no config file at {tmp_path}/nope.json yet" in result.stderr, result.stderr
