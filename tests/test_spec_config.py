"""Every config.json key, its default and its fallback (SPEC §3)."""
from __future__ import annotations

import json

import pytest

from atb_probe.config import DEFAULTS, DumpConfig, ExecRange, parse_config

from harness import config as full_config


def parse(**doc):
    cfg, warnings = parse_config(json.dumps(doc))
    assert cfg is not None
    return cfg, warnings


def test_full_document_parses_without_warnings():
    cfg, warnings = parse(**full_config(task="all", exec_range="0,2", ids="0,2_1",
                                        op_name="Word,LlamaAttention", save_child=True,
                                        device="0,3", filter_level=2))
    assert warnings == []
    assert cfg.task == "all" and cfg.dump_enable is True
    assert cfg.exec_range.pairs == ((0, 2),)
    assert cfg.ids == ("0", "2_1")
    assert cfg.op_name == ("word", "llamaattention")
    assert cfg.save_child is True and cfg.device == (0, 3) and cfg.filter_level == 2


def test_empty_object_gives_every_default_with_one_warning_naming_every_key():
    cfg, warnings = parse()
    assert cfg == DumpConfig()
    assert cfg.task == "tensor" and cfg.dump_enable is False
    assert cfg.exec_range.pairs == ((0, 0),) and 0 in cfg.exec_range and 1 not in cfg.exec_range
    assert cfg.ids == () and cfg.op_name == () and cfg.save_child is False
    assert cfg.device == () and cfg.filter_level == 1
    assert len(warnings) == 1 and warnings[0].startswith(f"{len(DEFAULTS)} keys are missing")
    for key, default in DEFAULTS.items():
        assert f"'{key}' {json.dumps(default)} (" in warnings[0]


def test_one_missing_key_names_it_its_type_and_the_value_used():
    doc = {k: v for k, v in DEFAULTS.items() if k != "ids"}
    cfg, warnings = parse_config(json.dumps(doc))
    assert warnings == ["'ids' is missing; using the default \"\" (str)"]


@pytest.mark.parametrize("key,bad,expected_type", [
    ("task", 1, "str"), ("dump_enable", "true", "bool"), ("exec_range", [0, 1], "str"),
    ("ids", 2, "str"), ("op_name", None, "str"), ("save_child", 1, "bool"),
    ("device", 0, "str"), ("filter_level", "1", "int"), ("filter_level", True, "int"),
    ("filter_level", 1.0, "int"),
])
def test_wrong_type_falls_back_to_the_default_and_names_key_type_and_value(key, bad,
                                                                            expected_type):
    cfg, warnings = parse(**full_config(**{key: bad}))
    default_cfg, _ = parse(**full_config(**{key: DEFAULTS[key]}))
    assert cfg == default_cfg
    assert len(warnings) == 1
    w = warnings[0]
    assert f"'{key}'" in w and f"must be {expected_type}" in w and json.dumps(bad) in w
    assert f"using the default {json.dumps(DEFAULTS[key])}" in w


@pytest.mark.parametrize("task", ["tensors", "stats", "", "ALL"])
def test_unknown_task_falls_back_to_tensor(task):
    cfg, warnings = parse(**full_config(task=task))
    assert cfg.task == "tensor" and len(warnings) == 1 and "'task'" in warnings[0]


@pytest.mark.parametrize("level", [-1, 3, 10**30])
def test_filter_level_outside_range_falls_back_to_1(level):
    cfg, warnings = parse(**full_config(filter_level=level))
    assert cfg.filter_level == 1 and len(warnings) == 1 and "filter_level" in warnings[0]


@pytest.mark.parametrize("text,inside,outside", [
    ("all", [0, 5, 10**6], []),
    ("none", [], [0, 1]),
    ("0,2", [0, 1, 2], [3]),
    ("1,1,4,5", [1, 4, 5], [0, 2, 3, 6]),
    (" 3 , 4 ", [3, 4], [2, 5]),
    ("0,5,2,3", [0, 3, 5], [6]),          # overlapping pairs are a union
])
def test_exec_range_forms(text, inside, outside):
    cfg, warnings = parse(**full_config(exec_range=text))
    assert warnings == []
    for r in inside:
        assert r in cfg.exec_range
    for r in outside:
        assert r not in cfg.exec_range


@pytest.mark.parametrize("text", ["1", "1,2,3", "a,b", "3,1", "-1,2", "", "1;2"])
def test_bad_exec_range_falls_back_to_round_zero(text):
    cfg, warnings = parse(**full_config(exec_range=text))
    assert cfg.exec_range == ExecRange()
    assert len(warnings) == 1 and "exec_range" in warnings[0] and '"0,0"' in warnings[0]


def test_list_items_are_trimmed_and_bad_ones_dropped_with_a_warning():
    cfg, warnings = parse(**full_config(ids=" 2 ,a_b,2__1,,3_0", device="1, x,2"))
    assert cfg.ids == ("2", "3_0")
    assert cfg.device == (1, 2)
    assert any("'a_b'" in w and "'2__1'" in w for w in warnings)
    assert any("empty items" in w for w in warnings)
    assert any("'device'" in w and "'x'" in w for w in warnings)


def test_unknown_key_is_reported_and_ignored():
    cfg, warnings = parse(**full_config(dump_enabled=True))
    assert cfg.dump_enable is True
    assert warnings == [w for w in warnings if "unknown key 'dump_enabled'" in w] and warnings


@pytest.mark.parametrize("text", ['{"task": "tensor", "dump_en', "[1, 2]", "null", "", "42"])
def test_unusable_document_keeps_the_last_good_configuration(text):
    cfg, warnings = parse_config(text)
    assert cfg is None
    assert len(warnings) == 1 and "keeping the last good configuration" in warnings[0]


def test_example_config_beside_the_script_is_complete_and_asleep():
    from harness import SCRIPTS
    cfg, warnings = parse_config((SCRIPTS / "config.json").read_text())
    assert warnings == [] and cfg.dump_enable is False
