"""docs/engines.md, "vLLM served, step by step", run as the page gives it: every `bash` block of
that section, in order, in one shell in an empty folder (the port changed to a free one), as a
new user would paste them. The walkthrough ends with the dump of exactly the request's steps,
each process named by its role, and `atb-probe status` saying WAITING before the request and
COMPLETE only after it."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from harness import free_port, status_docs  # noqa: E402
from vllm_harness import LAYER_OPS, engine_env, layer_ops, vllm_cache, worker_dir  # noqa: E402

__all__ = ["vllm_cache"]  # fixtures

PAGE = Path(__file__).resolve().parents[2] / "docs" / "engines.md"
SECTION = "## vLLM served, step by step"


def walkthrough_blocks(page: Path) -> list[str]:
    """The `bash` blocks of the walkthrough section, dedented, in page order."""
    text = page.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start:end if end >= 0 else None]
    blocks = re.findall(r"^( *)```bash\n(.*?)^\1```$", section, flags=re.S | re.M)
    return [textwrap.dedent(body) for _, body in blocks]


def run_script(script: Path, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`bash script` to its end, in a session of its own so that the server it leaves behind
    on a failure is ended with it."""
    proc = subprocess.Popen(["bash", str(script)], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the walkthrough did not end in {timeout} s:\n{out[-4000:]}\n{err[-6000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left running
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# vLLM starts in 55-80 s on 2 free cores; a busy machine takes several times that.
@pytest.mark.timeout(1800)
def test_the_served_walkthrough_runs_as_written_and_dumps_the_requests_steps(tmp_path,
                                                                           vllm_cache):
    blocks = walkthrough_blocks(PAGE)
    assert len(blocks) == 6, blocks
    script = "\n".join(blocks).replace("8000", str(free_port()))
    (tmp_path / "walkthrough.sh").write_text(script)
    folder = tmp_path / "work"
    folder.mkdir()
    env = engine_env(vllm_cache)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    result = run_script(tmp_path / "walkthrough.sh", folder, env, timeout=1700)
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-6000:]

    # Before the request: the worker waits for its steps. After it: four steps, on disk.
    assert "WAITING: no selected round has run yet" in out
    answer = json.loads(next(line for line in out.splitlines() if '"choices"' in line))
    assert answer["usage"]["completion_tokens"] == 4
    root = folder / "atb_dump_data"
    proc = worker_dir(root)
    assert sorted(int(p.name) for p in proc.iterdir()) == [0, 1, 2, 3]
    for index in range(4):
        assert layer_ops(proc / str(index)) == LAYER_OPS

    # Every process said what it is, and the clean stop reads as one.
    docs = status_docs(root)
    workers = [d for d in docs if d["role"] == "worker"]
    assert len(workers) == 1 and workers[0]["rounds_dumped"] == 4
    assert f"{workers[0]['device']}_{workers[0]['pid']}" == proc.name
    # The API server, the engine core and a helper vLLM runs while it loads.
    engines = [d for d in docs if d["role"] == "engine"]
    assert len(engines) == len(docs) - 1 >= 2 and all(d["rounds_dumped"] == 0 for d in engines)
    assert all(d["exited"] for d in docs), (docs, result.stderr[-6000:])
    assert all(d["dtype_notice"] is None for d in docs)
    final = out[out.rindex("\n", 0, out.index('"choices"')):]
    assert "COMPLETE" in final and "killed" not in final and " gone " not in final, final
    shown = " ".join(final.split())
    assert "round 0 model=LlamaForCausalLM phase=Prefill task=statistics" in shown
    for index in (1, 2, 3):
        assert f"round {index} model=LlamaForCausalLM phase=Decoder" in shown
