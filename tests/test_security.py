"""Security of the output tree (issue #6, SPEC §6): modes 0750/0640 whatever the umask, no write
through a planted symbolic link, hostile op and class names cannot escape or break the tree, and
paths over 2048 characters are refused with a message. (The config file side is in
test_config_abuse.py: only read as JSON, regular files only, size limit, world-writable refused.)"""
from __future__ import annotations

import csv
import os
import re
import stat
from pathlib import Path

import pytest
import torch
from torch import nn

import atb_probe
from atb_probe.binfile import read_header
from atb_probe.record.safefs import MAX_PATH, SafeTree, UnsafePathError
from atb_probe.statcsv import COLUMNS

from conftest import generate, tiny_llama
from harness import config

SAFE_COMPONENT = re.compile(r"[A-Za-z0-9_.\-]{1,255}")


def dump_llama(out: Path, **cfg) -> Path:
    model = tiny_llama()
    atb_probe.enable(str(out), config(**cfg))
    try:
        generate(model, new_tokens=1)
    finally:
        assert atb_probe.disable(timeout=60)
    return out / "atb_dump_data"


def tree_entries(root: Path) -> list[Path]:
    return [Path(d) / n for d, dirs, files in os.walk(root) for n in dirs + files]


def check_complete(root: Path) -> None:
    """Every .bin parses against its own size; every csv row is whole; no temporary files."""
    for path in tree_entries(root):
        assert not path.name.endswith(".tmp"), path
        if path.suffix == ".bin":
            read_header(path)
        if path.name == "statistic.csv":
            with open(path, newline="") as f:
                rows = list(csv.reader(f))
            assert rows[0] == list(COLUMNS)
            assert all(len(r) == len(COLUMNS) for r in rows), path


# -- modes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_directories_are_0750_and_files_0640_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        root = dump_llama(tmp_path, save_child=True)
    finally:
        os.umask(old)
    entries = tree_entries(root) + [root]
    assert len(entries) > 50
    for path in entries:
        mode = stat.S_IMODE(path.lstat().st_mode)
        assert mode == (0o750 if path.is_dir() else 0o640), (oct(mode), path)


# -- symbolic links -------------------------------------------------------------------------


def test_symlinked_atb_dump_data_is_not_written_through(tmp_path, capfd):
    victim = tmp_path / "victim"
    victim.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "atb_dump_data").symlink_to(victim)
    dump_llama(out)
    assert list(victim.iterdir()) == []
    assert (out / "atb_dump_data").is_symlink()
    assert "symbolic link" in capfd.readouterr().err


def test_symlink_planted_inside_the_tree_is_not_written_through(tmp_path, capfd):
    victim = tmp_path / "victim"
    victim.mkdir()
    data = tmp_path / "atb_dump_data" / "data"
    data.mkdir(parents=True)
    (data / f"0_{os.getpid()}").symlink_to(victim)         # this process's own folder
    (tmp_path / "atb_dump_data" / "info").symlink_to(victim)
    dump_llama(tmp_path)
    assert list(victim.iterdir()) == []
    err = capfd.readouterr().err
    assert "symbolic link" in err and "Traceback" not in err


def test_symlink_planted_at_a_file_name_is_replaced_not_written_through(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("keep me")
    round_dir = tmp_path / "atb_dump_data" / "data" / f"0_{os.getpid()}" / "0"
    (round_dir / "0_Embedding" / "after").mkdir(parents=True)
    (round_dir / "0_Embedding" / "after" / "outtensor0.bin").symlink_to(secret)
    (round_dir / "statistic.csv").symlink_to(secret)
    root = dump_llama(tmp_path)
    assert secret.read_text() == "keep me"
    for planted in (round_dir / "0_Embedding" / "after" / "outtensor0.bin",
                    round_dir / "statistic.csv"):
        assert not planted.is_symlink() and planted.is_file()
    check_complete(root)


def test_safe_tree_refuses_links_in_any_directory_component(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    tree = SafeTree(str(tmp_path / "root"))
    tree.makedirs("a/b")
    os.rename(tmp_path / "root" / "a" / "b", tmp_path / "b-moved")
    (tmp_path / "root" / "a" / "b").symlink_to(victim)
    fresh = SafeTree(str(tmp_path / "root"))  # no cached descriptors
    with pytest.raises(UnsafePathError, match="symbolic link"):
        fresh.write_file("a/b/c", "x.bin", [b"data"])
    with pytest.raises(UnsafePathError, match="symbolic link"):
        fresh.append_lines("a/b", "s.csv", b"1\n", b"h\n")
    assert list(victim.iterdir()) == []


def test_fifo_planted_at_the_csv_name_does_not_block_the_writer(tmp_path):
    tree = SafeTree(str(tmp_path / "root"))
    tree.makedirs("r")
    os.mkfifo(tmp_path / "root" / "r" / "statistic.csv")
    tree.append_lines("r", "statistic.csv", b"1,2\n", b"a,b\n")
    assert (tmp_path / "root" / "r" / "statistic.csv").read_text() == "a,b\n1,2\n"


@pytest.mark.parametrize("name", ["../x.bin", "a/b.bin", "..", ".", "", "x\0.bin", "x" * 256])
def test_safe_tree_refuses_names_that_are_not_one_short_component(tmp_path, name):
    tree = SafeTree(str(tmp_path / "root"))
    with pytest.raises(UnsafePathError):
        tree.write_file("d", name, [b"x"])
    with pytest.raises(UnsafePathError):
        tree.append_lines("d", name, b"x\n")
    if "/" not in name:
        with pytest.raises(UnsafePathError):
            tree.makedirs(f"d/{name}/e")
    assert [p.name for p in tree_entries(tmp_path)] in ([], ["root"], ["root", "d"])


# -- hostile names --------------------------------------------------------------------------

HOSTILE = ["../../escape", "a/b", "..", ".hidden", "\x1b[31mred\nline\r", "tab\tcomma,quote\"",
           "x" * 1000, "\u202egnp.exe", "名字"]


class _Takes(nn.Module):
    """A child module called with a dict whose key is a path (a parameter name, later)."""

    def forward(self, inputs):
        return next(iter(inputs.values())) * 2


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.takes = _Takes()

    def forward(self, x):
        return self.takes({"../../../../escape": self.inner(x)}).relu()


class _Root(nn.Module):
    def __init__(self, names):
        super().__init__()
        self.layers = nn.ModuleList(type(n, (_Block,), {})() for n in names)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_hostile_op_class_and_parameter_names_cannot_escape_or_break_the_tree(tmp_path, capfd):
    out = tmp_path / "a" / "b" / "out"
    model = _Root(HOSTILE)
    expected = model(torch.ones(2, 8))
    atb_probe.enable(str(out), config(save_child=True))
    try:
        got = model(torch.ones(2, 8))
    finally:
        assert atb_probe.disable(timeout=60)
    assert torch.equal(got, expected)
    # Nothing was created outside the output folder.
    assert sorted(str(p.relative_to(tmp_path)) for p in tree_entries(tmp_path)
                  if "atb_dump_data" not in p.parts) == ["a", "a/b", "a/b/out"]
    root = out / "atb_dump_data"
    entries = tree_entries(root)
    for path in entries:
        for part in path.relative_to(root).parts:
            assert SAFE_COMPONENT.fullmatch(part) and part not in (".", ".."), path
    check_complete(root)
    rows = [r for p in entries if p.name == "statistic.csv"
            for r in csv.DictReader(open(p, newline=""))]
    layers = {(r["Op Id"].partition("_")[0], r["Op Name"].partition("/")[0]) for r in rows}
    assert len(layers) == len(HOSTILE)
    assert all(SAFE_COMPONENT.fullmatch(name) and len(name) <= 200 for _, name in layers)
    # The dict key became part of a file name: it is sanitised into one safe component.
    hostile = [r for r in rows if "escape" in r["Index"]]
    assert hostile and all(SAFE_COMPONENT.fullmatch(r["Index"]) for r in hostile)
    assert all(Path(r["Tensor Path"]).is_file() for r in hostile)  # sanitised, not lost
    for r in rows:
        if r["Tensor Path"] != "N/A":
            assert Path(r["Tensor Path"]).is_file()
    err = capfd.readouterr().err
    assert "Traceback" not in err


# -- path length ----------------------------------------------------------------------------


def test_paths_over_2048_characters_are_refused_with_a_message(tmp_path, capfd):
    out = tmp_path
    while len(str(out)) < MAX_PATH - 170:
        out = out / ("d" * 100)
    # 67 characters left, whatever the length of pytest's temporary folder: enough for
    # ".../0/0_Embedding/before/intensor0.bin", not for ".../0/2_LlamaDecoderLayer/...".
    out = out / ("e" * (MAX_PATH - 67 - len(str(out)) - 1))
    root = dump_llama(out)
    err = capfd.readouterr().err
    assert f"over the {MAX_PATH} limit" in err and "Traceback" not in err
    assert sum(f"over the {MAX_PATH} limit" in line for line in err.splitlines()) == 1
    entries = tree_entries(root)
    assert all(len(str(p)) <= MAX_PATH for p in entries)
    rows = [r for p in entries if p.name == "statistic.csv"
            for r in csv.DictReader(open(p, newline=""))]
    refused = [r for r in rows if r["Tensor Path"] == "N/A"]
    written = [r for r in rows if r["Tensor Path"] != "N/A"]
    assert refused and written  # the limit falls inside this dump
    assert all(Path(r["Tensor Path"]).is_file() for r in written)
    check_complete(root)
