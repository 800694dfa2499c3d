"""The load/unload scripts and the bootstrap (SPEC §2), with real shells and processes."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import LLAMA_SCRIPT, read_csv
from harness import SCRIPTS, cli, clean_env, config, run_loaded, run_shell


def test_unmodified_script_run_after_sourcing_produces_the_tree(tmp_path):
    result = run_loaded(tmp_path, LLAMA_SCRIPT, config(task="all", exec_range="0,0"))
    assert result.returncode == 0, result.stderr
    assert "OK 8" in result.stdout
    assert "Ready to dump ATB data, the running speed of the model will be affected" in \
        result.stderr
    procs = list((tmp_path / "atb_dump_data" / "data").iterdir())
    assert len(procs) == 1 and procs[0].name.startswith("0_")
    rows = read_csv(procs[0] / "0" / "statistic.csv")
    assert {r["Op Id"] for r in rows} == {"0", "1", "2", "3", "4", "5"}
    assert all(Path(r["Tensor Path"]).is_file() for r in rows)
    assert (tmp_path / "atb_dump_data" / "info" / "model" / procs[0].name /
            "LlamaForCausalLM_Prefill.json").is_file()


def test_unload_restores_pythonpath_and_variables_exactly(tmp_path):
    script = f"""
        export PYTHONPATH="/opt/a::/opt/b:"
        export KEEP=1
        before="$(env | sort)"
        source "{SCRIPTS}/load_atb_probe.sh" --output=out --config=cfg.json
        case "$PYTHONPATH" in *_bootstrap:/opt/a::/opt/b:) echo LOADED ;; esac
        [ "$ATB_OUTPUT_DIR" = "$PWD/out" ] && [ "$ATB_DUMP_CONFIG" = "$PWD/cfg.json" ] && echo ABS
        source "{SCRIPTS}/load_atb_probe.sh" --output=out --config=cfg.json
        echo "$PYTHONPATH" | tr ':' '\\n' | grep -c _bootstrap
        source "{SCRIPTS}/unload_atb_probe.sh"
        after="$(env | sort)"
        [ "$before" = "$after" ] && echo RESTORED
    """
    result = run_shell(script, tmp_path)
    assert result.stdout.split() == ["LOADED", "ABS", "1", "RESTORED"], result.stderr


def test_unload_unsets_a_pythonpath_that_was_not_set(tmp_path):
    script = f"""
        unset PYTHONPATH
        source "{SCRIPTS}/load_atb_probe.sh"
        source "{SCRIPTS}/unload_atb_probe.sh"
        echo "${{PYTHONPATH-unset}} ${{ATB_OUTPUT_DIR-unset}} ${{ATB_DUMP_CONFIG-unset}}"
    """
    assert run_shell(script, tmp_path).stdout.split() == ["unset"] * 3


def test_defaults_are_current_directory_and_config_beside_the_script(tmp_path):
    script = f"""
        source "{SCRIPTS}/load_atb_probe.sh"
        echo "$ATB_OUTPUT_DIR"
        echo "$ATB_DUMP_CONFIG"
    """
    out = run_shell(script, tmp_path).stdout.split()
    assert out == [str(tmp_path), str(SCRIPTS / "config.json")]


def test_more_than_two_arguments_warn_and_load_nothing(tmp_path):
    script = f"""
        source "{SCRIPTS}/load_atb_probe.sh" --output=a --config=b --extra
        echo "rc=$? ${{ATB_DUMP_CONFIG-unset}} ${{PYTHONPATH-unset}}"
    """
    result = run_shell(script, tmp_path, clean_env(PYTHONPATH="/x"))
    assert result.stdout.split() == ["rc=1", "unset", "/x"]
    assert "WARNING" in result.stderr and "Nothing was loaded" in result.stderr


def test_config_may_be_created_after_the_process_started(tmp_path):
    script = """
        import json, os, time, torch
        from torch import nn
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        model(torch.randn(1, 4))                      # asleep: no config yet
        cfg = dict(task="tensor", dump_enable=True, exec_range="all", ids="", op_name="",
                   save_child=False, device="", filter_level=1)
        with open(os.environ["ATB_DUMP_CONFIG"], "w") as f:
            json.dump(cfg, f)
        deadline = time.time() + 10
        while not os.path.isdir(os.path.join(os.environ["ATB_OUTPUT_DIR"], "atb_dump_data", "data")):
            assert time.time() < deadline
            time.sleep(0.05)
        model(torch.randn(1, 4))
        print("DONE")
    """
    result = run_loaded(tmp_path, script, cfg=None)
    assert result.returncode == 0, result.stderr
    rounds = list((tmp_path / "atb_dump_data" / "data").glob("*/*"))
    assert [r.name for r in rounds] == ["0"]   # rounds are counted from the wake-up
    assert (rounds[0] / "0_Linear" / "after" / "outtensor0.bin").is_file()


def test_process_that_never_imports_torch_is_untouched(tmp_path):
    result = run_loaded(tmp_path, "import json\nprint('plain')\n", config())
    assert result.returncode == 0 and result.stdout.strip() == "plain"
    assert "torch" not in result.stderr
    assert not (tmp_path / "atb_dump_data").exists()


def test_existing_sitecustomize_still_runs(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = 'yes'\n")
    script = "import os, torch\nprint(os.environ.get('USER_SITE_RAN'))\n"
    result = run_loaded(tmp_path, script, config(dump_enable=False),
                        env={"PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "yes"


def test_atb_probe_where_and_run(tmp_path):
    where = cli("where")
    assert where.returncode == 0 and Path(where.stdout.strip()) == SCRIPTS
    assert (SCRIPTS / "load_atb_probe.sh").is_file() and (SCRIPTS / "config.json").is_file()
    (tmp_path / "config.json").write_text(json.dumps(config()))
    (tmp_path / "m.py").write_text("import torch\nfrom torch import nn\n"
                                   "nn.Sequential(nn.Linear(2, 2), nn.Tanh())(torch.ones(1, 2))\n")
    result = cli("run", f"--output={tmp_path}", f"--config={tmp_path / 'config.json'}", "--",
                 sys.executable, tmp_path / "m.py", timeout=120)
    assert result.returncode == 0, result.stderr
    assert list((tmp_path / "atb_dump_data" / "data").glob("*/0/1_Tanh/after/outtensor0.bin"))


def test_the_cli_itself_never_dumps(tmp_path):
    script = f"""
        source "{SCRIPTS}/load_atb_probe.sh" --output={tmp_path} --config={tmp_path}/c.json
        "{sys.executable}" -c "import atb_probe.cli, torch; torch.nn.Linear(2, 2)(torch.ones(2))"
    """
    (tmp_path / "c.json").write_text(json.dumps(config()))
    result = run_shell(script, tmp_path)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "atb_dump_data").exists()
