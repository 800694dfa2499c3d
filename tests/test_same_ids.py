"""The probe never changes which kernels a model dispatches (SPEC §10): one run dumped with
`task: statistics` and with `task: tensor` has the same op IDs, kernels included.

What the probe does with a tensor must not show in the model's run. One way it could: PyTorch's
factory functions (`torch.arange`, `torch.zeros`...) hand their result to autograd, which makes
a shallow copy, an `aten.detach` the kernel capture sees, when something else holds that result
(capture/kernels.py, `Kernel.factory`). T5's relative-position bucket starts with two such
calls, so its attention is where a statistics dump and a tensor dump once drifted apart.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from conftest import dump, generate, only_proc, read_csv, tiny_llama
from harness import config
from test_families import tiny_t5


def _op_ids(root: Path) -> dict[str, list[tuple[str, str]]]:
    """{round: its ops in statistic.csv order, each once, as (Op Id, Op Name)}."""
    rounds = {}
    for folder in sorted(only_proc(root).iterdir()):
        rows = read_csv(folder / "statistic.csv")
        rounds[folder.name] = list(dict.fromkeys((r["Op Id"], r["Op Name"]) for r in rows))
    return rounds


def _structure(root: Path) -> dict[str, list]:
    """{layer file: the opName tree of its nodes}."""
    def names(nodes):
        return [(n["opName"], names(n.get("nodes", []))) for n in nodes]
    return {p.relative_to(root).parts[-1]: names(json.loads(p.read_text())["nodes"])
            for p in sorted((root / "info" / "layer").rglob("*.json"))}


def _both_tasks(tmp: Path, run) -> tuple[Path, Path]:
    """The dumps of `run` with every op and kernel recorded, in each task."""
    roots = []
    for task in ("statistics", "tensor"):
        with torch.no_grad():
            roots.append(dump(tmp / task, config(task=task, exec_range="all", save_child=True),
                              run))
    return roots[0], roots[1]


def _assert_same_ops(statistics: Path, tensor: Path) -> None:
    ids = _op_ids(statistics)
    assert ids == _op_ids(tensor)
    assert _structure(statistics) == _structure(tensor)
    kernels = [name for ops in ids.values() for _, name in ops if name.endswith("Kernel")]
    assert kernels and not any(name.endswith("/DetachKernel") for name in kernels)


def test_t5_has_the_same_op_ids_in_a_statistics_dump_and_a_tensor_dump(tmp_path):
    model = tiny_t5()
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    statistics, tensor = _both_tasks(tmp_path, lambda: model.generate(
        prompt, max_new_tokens=2, do_sample=False))
    _assert_same_ops(statistics, tensor)
    ops = _op_ids(statistics)["0"]
    assert any(name.endswith("T5Attention/ArangeKernel") for _, name in ops)


def test_llama_has_the_same_op_ids_in_a_statistics_dump_and_a_tensor_dump(tmp_path):
    model = tiny_llama()
    _assert_same_ops(*_both_tasks(tmp_path, lambda: generate(model, 4, 2)))


def test_statistics_of_a_factory_output_are_its_values(tmp_path):
    """Computed at once rather than at the end of the layer: still the values it returned."""
    model = tiny_t5()
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        root = dump(tmp_path, config(task="statistics", exec_range="0,0", save_child=True),
                    lambda: model.generate(prompt, max_new_tokens=1, do_sample=False))
    rows = read_csv(only_proc(root) / "0" / "statistic.csv")
    arange = next(r for r in rows if r["Op Name"].endswith("T5Attention/ArangeKernel")
                  and r["Input/Output"] == "output")
    assert (float(arange["Max"]), float(arange["Min"])) == (5.0, 0.0)  # arange(6)
