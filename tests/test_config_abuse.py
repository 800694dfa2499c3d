"""Config abuse (issue #6): a broken, hostile or odd config file gets one clear warning and a
defined behaviour (the last good configuration, or the default), never an exception in the host
program and never a hang. The file is only ever read as JSON data."""
from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import atb_probe
from atb_probe.config import (DEFAULTS, MAX_CONFIG_BYTES, TASKS, ConfigFileError, DumpConfig,
                              parse_config, read_config_file)
from atb_probe.process.configwatch import ConfigWatcher

from conftest import tiny_llama
from harness import config, run, status_of, wait_until

FULL = json.dumps(config(exec_range="0,3", ids="0,2_1", op_name="Linear", device="0"))


def load(path) -> tuple[DumpConfig | None, list[str]]:
    """What the probe does with a config file: read it safely, then parse it."""
    try:
        text = read_config_file(str(path))
    except ConfigFileError as exc:
        return None, [str(exc)]
    if text is None:
        return None, []
    return parse_config(text)


def my_status(out: Path) -> dict:
    """The status document of this process's probe writing to `out`."""
    return status_of(out / "atb_dump_data", os.getpid())


def in_thread(fn, timeout: float = 5.0):
    """Run `fn` in a thread; fail (instead of hanging the test run) if it does not return."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn} did not return within {timeout} s"
    return result["value"]


def check_invariants(cfg: DumpConfig) -> None:
    """Whatever the document, the configuration the probe gets is a valid one."""
    assert cfg.task in TASKS
    assert type(cfg.dump_enable) is bool and type(cfg.save_child) is bool
    assert type(cfg.filter_level) is int and 0 <= cfg.filter_level <= 2
    assert all(p and all(part.isdigit() and part.isascii() for part in p.split("_"))
               for p in cfg.ids)
    assert all(type(d) is int and d >= 0 for d in cfg.device)
    assert all(n and n.strip() == n for n in cfg.op_name)
    er = cfg.exec_range
    assert er.everything or all(0 <= lo <= hi for lo, hi in er.pairs)
    assert isinstance(0 in er, bool)


# -- documents ------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "not json at all", "{'task': 'all'}", '{"task": "all",}', "[1, 2, 3]",
    json.dumps([json.loads(FULL)]), "null", "true", "42", '"tensor"', "", "\x00\x00",
    "{" * 100_000,  # deeper than the JSON parser's recursion limit
])
def test_unusable_document_keeps_the_last_good_configuration_with_one_warning(text):
    cfg, warnings = parse_config(text)
    assert cfg is None
    assert len(warnings) == 1 and "keeping the last good configuration" in warnings[0]


def test_every_truncation_of_a_document_caught_mid_write_is_refused_with_one_warning():
    for n in range(len(FULL)):
        cfg, warnings = parse_config(FULL[:n])
        assert cfg is None, FULL[:n]
        assert len(warnings) == 1 and "last good configuration" in warnings[0]
    assert parse_config(FULL) == (parse_config(FULL)[0], [])


def test_byte_order_mark_from_an_editor_is_accepted():
    cfg, warnings = parse_config("\ufeff" + FULL)
    assert warnings == [] and cfg.exec_range.pairs == ((0, 3),)


def test_every_key_of_the_wrong_type_gives_the_defaults_and_one_warning_per_key():
    wrong = {"task": 1, "dump_enable": "yes", "exec_range": [0, 1], "ids": 2,
             "op_name": {"a": 1}, "save_child": None, "device": 0.5, "filter_level": "2"}
    cfg, warnings = parse_config(json.dumps(wrong))
    assert cfg == DumpConfig()
    assert len(warnings) == len(DEFAULTS)
    for key in DEFAULTS:
        assert sum(f"'{key}' must be" in w for w in warnings) == 1, key


@pytest.mark.parametrize("key,raw", [
    ("filter_level", "9" * 5000),                 # past Python's int-from-text limit
    ("filter_level", "1e999"),                    # a float that is infinite
    ("filter_level", "-" + "9" * 100),
    ("task", "1" * 10000),
])
def test_huge_numbers_fall_back_to_the_default_quickly(key, raw):
    doc = FULL[:-1] + f', "{key}": {raw}}}'
    start = time.monotonic()
    cfg, warnings = parse_config(doc)
    assert time.monotonic() - start < 1
    assert getattr(cfg, key) == getattr(DumpConfig(), key)
    assert len(warnings) == 1 and f"'{key}'" in warnings[0] and len(warnings[0]) < 300


@pytest.mark.parametrize("key,value", [
    ("exec_range", "0," + "9" * 5000), ("exec_range", "9" * 19 + "," + "9" * 19),
    ("device", "9" * 5000), ("ids", "1_" * 50000 + "x"),
])
def test_huge_numbers_inside_strings_are_refused_with_a_short_warning(key, value):
    cfg, warnings = parse_config(FULL[:-1] + f', "{key}": "{value}"}}')
    check_invariants(cfg)
    assert len(warnings) == 1 and f"'{key}'" in warnings[0] and len(warnings[0]) < 300


def test_large_round_numbers_that_fit_are_accepted():
    cfg, warnings = parse_config(json.dumps(config(exec_range="0,999999999999999999")))
    assert warnings == [] and 10**17 in cfg.exec_range


@pytest.mark.parametrize("text,pairs,warned", [
    ("-1,2", ((0, 0),), True),
    ("1,-2", ((0, 0),), True),
    ("0,5,3,8", ((0, 5), (3, 8)), False),       # overlapping pairs: their union
    ("2,2,2,2", ((2, 2), (2, 2)), False),
    ("5,2", ((0, 0),), True),                   # reversed
    ("0,1,5,2", ((0, 0),), True),               # one reversed pair spoils the value
    ("1", ((0, 0),), True),                     # odd counts
    ("1,2,3", ((0, 0),), True),
    ("1,2,3,4,5", ((0, 0),), True),
    ("1,,2", ((0, 0),), True),
    (",", ((0, 0),), True),
    ("0x1,2", ((0, 0),), True),
    ("１,２", ((0, 0),), True),                   # full-width digits are not round numbers
    ("1.0,2", ((0, 0),), True),
])
def test_exec_range_pairs(text, pairs, warned):
    cfg, warnings = parse_config(json.dumps(config(exec_range=text)))
    assert cfg.exec_range.pairs == pairs
    assert len(warnings) == int(warned)
    if warned:
        assert "exec_range" in warnings[0] and '"0,0"' in warnings[0]


@pytest.mark.parametrize("text,ids,warned", [
    ("a_b", (), 1), ("2__1", (), 1), (" 2 ", ("2",), 0), ("1,,2", ("1", "2"), 1),
    (",", (), 1), ("_1", (), 1), ("1_", (), 1), ("٣", (), 1), ("2_1, 2_1", ("2_1",), 0),
    ("0, 10_3 ,x", ("0", "10_3"), 1),
])
def test_ids_items(text, ids, warned):
    cfg, warnings = parse_config(json.dumps(config(ids=text)))
    assert cfg.ids == ids
    assert len(warnings) == warned


# -- files ----------------------------------------------------------------------------------


def test_missing_file_means_no_configuration_and_no_warning(tmp_path):
    assert load(tmp_path / "absent.json") == (None, [])
    assert load(tmp_path / "not-a-dir" / "config.json") == (None, [])


def test_file_over_the_size_limit_is_refused_without_being_read(tmp_path):
    path = tmp_path / "huge.json"
    with open(path, "wb") as f:  # 100 MB, sparse: refusing it must not read it
        f.truncate(100 * 1024 * 1024)
    start = time.monotonic()
    cfg, warnings = load(path)
    assert time.monotonic() - start < 0.5
    assert cfg is None and len(warnings) == 1
    assert f"the limit is {MAX_CONFIG_BYTES}" in warnings[0]


def test_file_just_under_the_size_limit_is_read(tmp_path):
    path = tmp_path / "padded.json"
    path.write_text(FULL + " " * (MAX_CONFIG_BYTES - len(FULL)))
    cfg, warnings = load(path)
    assert warnings == [] and cfg is not None


def test_directory_is_refused(tmp_path):
    cfg, warnings = load(tmp_path)
    assert cfg is None and len(warnings) == 1 and "is a directory" in warnings[0]


def test_fifo_is_refused_without_hanging(tmp_path):
    path = tmp_path / "config.json"
    os.mkfifo(path)
    cfg, warnings = in_thread(lambda: load(path))
    assert cfg is None and len(warnings) == 1 and "is a FIFO" in warnings[0]


def test_symlink_to_dev_zero_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "config.json"
    path.symlink_to("/dev/zero")
    cfg, warnings = in_thread(lambda: load(path))
    assert cfg is None and len(warnings) == 1 and "character device" in warnings[0]


def test_socket_and_symlink_loop_are_refused(tmp_path):
    sock_path = tmp_path / "s.json"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    try:
        cfg, warnings = load(sock_path)
        assert cfg is None and len(warnings) == 1 and "socket" in warnings[0]
    finally:
        sock.close()
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)
    cfg, warnings = load(loop)
    assert cfg is None and len(warnings) == 1 and "cannot be opened" in warnings[0]


def test_symlink_to_a_good_file_is_followed(tmp_path):
    (tmp_path / "real.json").write_text(FULL)
    (tmp_path / "config.json").symlink_to(tmp_path / "real.json")
    cfg, warnings = load(tmp_path / "config.json")
    assert warnings == [] and cfg.exec_range.pairs == ((0, 3),)


def test_world_writable_file_is_refused_with_a_fix(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(FULL)
    path.chmod(0o666)
    cfg, warnings = load(path)
    assert cfg is None and len(warnings) == 1
    assert "writable by every user" in warnings[0] and f"chmod o-w {path}" in warnings[0]
    path.chmod(0o644)
    assert load(path)[1] == []


def test_file_that_is_code_is_not_executed(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "config.json"
    path.write_text(f"__import__('os').system('touch {marker}')")
    cfg, warnings = load(path)
    assert cfg is None and "not valid JSON" in warnings[0]
    path.write_text(json.dumps(config(task=f"$(touch {marker})", op_name=f"`touch {marker}`")))
    cfg, _ = load(path)
    assert cfg.task == "tensor" and not marker.exists()


def _unprivileged() -> list[str]:
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0:
        return []
    if setpriv is None:
        pytest.skip("setpriv is not available to drop root privileges")
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]


def test_file_without_read_permission_is_refused_with_a_warning(tmp_path):
    """Root reads anything, so as root the reading process drops to `nobody` (uid 65534)."""
    drop = _unprivileged()
    tmp_path.chmod(0o755)
    path = tmp_path / "config.json"
    path.write_text(FULL)
    path.chmod(0o600 if drop else 0o000)  # not root: its own file, with no read permission
    code = ("import sys\nfrom atb_probe.config import read_config_file, ConfigFileError\n"
            "try:\n    read_config_file(sys.argv[1])\n"
            "except ConfigFileError as exc:\n    print('REFUSED', exc)\n")
    src = str(Path(atb_probe.__file__).parents[1])
    done = run([*drop, sys.executable, "-c", code, path], timeout=60,
               env={**os.environ, "PYTHONPATH": src})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("REFUSED") and "permission denied" in done.stdout


# -- property-based -------------------------------------------------------------------------

JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                      st.text(max_size=30))
JSON_VALUE = st.recursive(JSON_LEAF, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=20)
NUMBERISH = st.text(alphabet="0123456789,_ -xa\t١", max_size=40)
KEY_VALUE = {
    "task": st.one_of(st.sampled_from(TASKS + ("ALL", "", "stats")), JSON_VALUE),
    "dump_enable": st.one_of(st.booleans(), JSON_VALUE),
    "exec_range": st.one_of(NUMBERISH, st.sampled_from(["all", "none", " ALL "]), JSON_VALUE),
    "ids": st.one_of(NUMBERISH, JSON_VALUE),
    "op_name": st.one_of(st.text(max_size=40), JSON_VALUE),
    "save_child": st.one_of(st.booleans(), JSON_VALUE),
    "device": st.one_of(NUMBERISH, JSON_VALUE),
    "filter_level": st.one_of(st.integers(-5, 5), st.integers(), JSON_VALUE),
}
DOCUMENTS = st.fixed_dictionaries({}, optional=KEY_VALUE).flatmap(
    lambda known: st.dictionaries(st.text(max_size=12), JSON_VALUE, max_size=3).map(
        lambda extra: {**extra, **known}))


@settings(max_examples=200, deadline=None)
@given(DOCUMENTS)
def test_any_config_object_gives_a_valid_configuration(doc):
    cfg, warnings = parse_config(json.dumps(doc))
    check_invariants(cfg)
    for w in warnings:
        assert w.isprintable() and len(w) < 600
    missing = [k for k in DEFAULTS if k not in doc]
    assert all(any(f"'{k}'" in w and "missing; using" in w for w in warnings) for k in missing)
    assert sum("missing; using" in w for w in warnings) == (1 if missing else 0)


VALID_DOCUMENTS = st.fixed_dictionaries({
    "task": st.sampled_from(TASKS),
    "dump_enable": st.booleans(),
    "exec_range": st.one_of(st.sampled_from(["all", "none"]), st.lists(
        st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)).map(sorted), min_size=1,
        max_size=4).map(lambda ps: ",".join(f"{a},{b}" for a, b in ps))),
    "ids": st.lists(st.lists(st.integers(0, 99), min_size=1, max_size=4).map(
        lambda p: "_".join(map(str, p))), max_size=4).map(",".join),
    "op_name": st.lists(st.from_regex(r"[A-Za-z][A-Za-z0-9]{0,10}", fullmatch=True),
                        max_size=3).map(",".join),
    "save_child": st.booleans(),
    "device": st.lists(st.integers(0, 15), max_size=3).map(lambda ds: ",".join(map(str, ds))),
    "filter_level": st.integers(0, 2),
})


@settings(max_examples=200, deadline=None)
@given(VALID_DOCUMENTS)
def test_any_valid_document_is_taken_as_written_without_warnings(doc):
    cfg, warnings = parse_config(json.dumps(doc))
    assert warnings == []
    check_invariants(cfg)
    assert (cfg.task, cfg.dump_enable, cfg.save_child, cfg.filter_level) == (
        doc["task"], doc["dump_enable"], doc["save_child"], doc["filter_level"])
    assert set(cfg.ids) == {i for i in doc["ids"].split(",") if i}
    assert set(cfg.device) == {int(d) for d in doc["device"].split(",") if d}
    if doc["exec_range"] not in ("all", "none"):
        nums = [int(x) for x in doc["exec_range"].split(",")]
        for lo, hi in zip(nums[::2], nums[1::2]):
            assert lo in cfg.exec_range and hi in cfg.exec_range


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=300), st.binary(max_size=300).map(
    lambda b: b.decode("utf-8", "replace")), VALID_DOCUMENTS.map(json.dumps).flatmap(
    lambda text: st.integers(0, len(text)).map(lambda n: text[:n]))))
def test_any_text_parses_or_is_refused_with_one_warning(text):
    cfg, warnings = parse_config(text)
    if cfg is None:
        assert len(warnings) == 1 and "last good configuration" in warnings[0]
    else:
        check_invariants(cfg)


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=2000), mode=st.sampled_from([0o644, 0o600, 0o666, 0o640]))
def test_any_file_content_loads_or_is_refused_without_raising(tmp_path, data, mode):
    path = tmp_path / "config.json"
    path.write_bytes(data)
    path.chmod(mode)
    cfg, warnings = load(path)
    if cfg is None:
        assert len(warnings) == 1
    else:
        check_invariants(cfg)
        assert not mode & stat.S_IWOTH


# -- the host program -----------------------------------------------------------------------


def _bad_config(kind: str, path: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "100MB":
        with open(path, "wb") as f:
            f.truncate(100 * 1024 * 1024)
    elif kind == "world-writable":
        path.write_text(json.dumps(config()))
        path.chmod(0o666)
    elif kind == "array":
        path.write_text(json.dumps([config()]))
    elif kind == "garbage":
        path.write_bytes(os.urandom(4096))
    if not path.is_symlink():  # an old file: the watcher does not wait for a save to settle
        os.utime(path, (time.time() - 3600,) * 2)


BAD_KINDS = ["fifo", "directory", "dev-zero", "100MB", "world-writable", "array", "garbage"]


def watcher(path: Path):
    """A ConfigWatcher of `path`, as the probe's background thread runs it; and the list of
    what it handed over (configurations, or None for none)."""
    applied = []
    return ConfigWatcher(str(path), applied.append, lambda: None), applied


def warnings_in(capfd, path: Path) -> list[str]:
    return [line for line in capfd.readouterr().err.splitlines()
            if "WARNING" in line and str(path) in line]


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_a_file_left_unusable_warns_once_however_many_polls(tmp_path, capfd, kind):
    path = tmp_path / "config.json"
    _bad_config(kind, path)
    watch, applied = watcher(path)
    watch.poll()
    assert watch.problem and warnings_in(capfd, path) == []  # perhaps an editor mid-save
    for _ in range(10):
        watch.poll()
    assert len(warnings_in(capfd, path)) == 1
    assert applied == [] or applied == [None]  # never a configuration from that file


def test_a_config_caught_mid_save_is_used_once_complete_without_a_warning(tmp_path, capfd):
    """An editor truncates, writes part of the file, pauses, writes the rest: a poll in the
    pause keeps the last good configuration and says nothing; the next one applies the file."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config(ids="0")))
    watch, applied = watcher(path)
    watch.poll()
    text = json.dumps(config(ids="3"))
    with open(path, "w") as f:
        f.write(text[:20])
        f.flush()
        watch.poll()  # in the editor's pause
        assert watch.problem and "not valid JSON" in watch.problem
        f.write(text[20:])
    watch.poll()
    assert [c.ids for c in applied] == [("0",), ("3",)]
    assert watch.problem is None and warnings_in(capfd, path) == []


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_host_program_runs_asleep_on_a_bad_config_file(tmp_path, capfd, kind):
    import torch
    path = tmp_path / "config.json"
    _bad_config(kind, path)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    in_thread(lambda: atb_probe.enable(str(tmp_path / "out"), config=str(path)))
    out = model(torch.ones(1, 4))
    assert my_status(tmp_path / "out")["config_problem"]  # read at once, when the probe started
    err = []

    def warned():
        err.append(capfd.readouterr().err)
        return any(str(path) in line and "WARNING" in line
                   for line in "".join(err).splitlines())

    # The warning waits for a later poll (the file might be mid-save); that it comes only once
    # however many polls follow is `test_a_file_left_unusable_warns_once_however_many_polls`.
    wait_until(warned, 10, "the warning about the config file")
    assert atb_probe.disable(timeout=10)
    assert out.shape == (1, 4)
    assert not (tmp_path / "out" / "atb_dump_data" / "data").exists()
    err = "".join(err) + capfd.readouterr().err
    assert sum(str(path) in line and "WARNING" in line for line in err.splitlines()) == 1, err


def test_config_broken_mid_run_keeps_the_last_good_one(tmp_path, capfd):
    path = tmp_path / "config.json"
    good = json.dumps(config(exec_range="all"))
    path.write_text(good)
    model = tiny_llama()
    import torch
    ids = torch.zeros(1, 4, dtype=torch.long)
    atb_probe.enable(str(tmp_path), config=str(path))
    try:
        with torch.no_grad():
            model(ids)
            path.write_text(good[:len(good) // 2])  # an editor caught half-way
            problem = wait_until(lambda: my_status(tmp_path)["config_problem"], 10,
                                 "the watcher to see the broken file")
            assert "not valid JSON" in problem
            model(ids)
    finally:
        assert atb_probe.disable(timeout=30)
    procs = list((tmp_path / "atb_dump_data" / "data").iterdir())
    assert sorted(p.name for p in procs[0].iterdir()) == ["0", "1"]
    err = capfd.readouterr().err
    assert sum("last good configuration" in line for line in err.splitlines()) <= 1
    assert "Traceback" not in err


def test_a_poll_beside_the_background_thread_returns_once_its_config_is_applied(tmp_path,
                                                                                monkeypatch):
    """The background thread has read a saved config and not yet applied it when another
    thread polls: that poll must not return before the config is in effect (it saw the file
    as already read, and returned at once)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config(dump_enable=False)))
    handing_over = threading.Event()
    hand_over = ConfigWatcher._hand_over

    def slow_hand_over(self, cfg):
        if threading.current_thread() is not threading.main_thread():
            handing_over.set()
            time.sleep(0.3)  # the background thread, preempted between reading and applying
        hand_over(self, cfg)

    probe = atb_probe.enable(str(tmp_path / "out"), config=str(path))
    monkeypatch.setattr(ConfigWatcher, "_hand_over", slow_hand_over)
    try:
        assert not probe.engine.awake
        fresh = tmp_path / "config.json.new"
        fresh.write_text(json.dumps(config()))
        fresh.replace(path)
        probe._wake_watcher()
        wait_until(handing_over.is_set, 10, "the background thread to read the new config")
        probe.poll_config()
        assert probe.engine.awake
    finally:
        monkeypatch.undo()
        assert atb_probe.disable(timeout=30)
