"""A dumped module op rebuilt to be called again (`atb-probe replay OP --weights PATH`): its class
from `op_param.json` (`class`), built from the model's config and what the dump records of it,
its parameters loaded from the user's weights by the names `op_param.json` records (`parameters`,
looked up under its `modulePath` prefix, else as they are), and its call from its recorded
inputs (`arguments`: which argument each input file is) and non-tensor arguments (`args`).

Nothing is guessed: what the dump does not record (an argument held as an object, a constructor
argument with no default, a parameter missing from the weights, inputs of a dump made before
`arguments` was recorded) raises kernelcall.CannotReplay saying what is missing.

The constructor's arguments are filled so: `config` from the weights folder's config.json (else
the model's config the dump records in info/model), with the attention implementation
transformers chooses for a model built from it (the dump does not record another choice),
`layer_idx` from the module path's last index (`model.layers.1` -> 1), others from `extra_repr`
(`in_features=32, out_features=64`; its leading values without a name are the first
positional parameters, as torch writes them: `Embedding`'s `64, 32`, `Conv1d`'s `4, 8,
kernel_size=(3,)`, `LayerNorm`'s `(32,), eps=1e-05`), the rest left to their defaults. A module
built so must have the parameter shapes the dump records.
"""
from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
import os
import re
from dataclasses import dataclass

import torch

from .kernelcall import CannotReplay, SkipReason

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
_LAYER_INDEX = ("layer_idx", "layer_id", "layer_index")
_UNRENDERED = re.compile(r"^<.*>$|\.\.\.$")   # capture/tensors.py `_plain` of an object


@dataclass(frozen=True, slots=True)
class ModuleParam:
    """What `op_param.json` says of a module op."""

    cls: str                          # `transformers.models.llama.modeling_llama.LlamaDecoderLayer`
    module_path: str                  # `model.layers.1`
    dtype: str | None                 # of its first parameter
    parameters: dict                  # name -> shape
    extra_repr: str
    args: dict                        # non-tensor arguments by name
    inputs: tuple[str, ...]           # input file labels (`0`, `0_hidden_states`)
    arguments: tuple[str, ...] | None   # the argument of each input file; None: not recorded
    outputs: tuple[str, ...]
    uninitialized: frozenset = frozenset()   # as KernelParam's: none for a module

    @classmethod
    def of(cls, doc: dict) -> ModuleParam:
        arguments = doc.get("arguments")
        return cls(doc.get("class", ""), doc.get("modulePath") or "", doc.get("dtype"),
                   dict(doc.get("parameters") or {}), doc.get("extra_repr") or "",
                   dict(doc.get("args") or {}), tuple(doc.get("inputs") or ()),
                   None if arguments is None else tuple(arguments),
                   tuple(doc.get("outputs") or ()))


def import_class(path: str) -> type:
    """The class a dotted path names (`torch.nn.modules.linear.Linear`)."""
    module_name, _, name = path.rpartition(".")
    try:
        found = importlib.import_module(module_name)
        for part in name.split("."):
            found = getattr(found, part)
    except Exception as exc:
        raise CannotReplay(SkipReason.UNKNOWN_OP, f"its class {path} cannot be imported here: "
                           f"{type(exc).__name__}: {exc}") from None
    if not (isinstance(found, type) and issubclass(found, torch.nn.Module)):
        raise CannotReplay(SkipReason.UNKNOWN_OP, f"{path} is not a torch.nn.Module class")
    return found


def weight_files(path: str) -> list[str]:
    """The safetensors files of `--weights`: a file, or a save_pretrained folder."""
    if os.path.isfile(path):
        return [path]
    index = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    single = os.path.join(path, SAFETENSORS)
    if os.path.isfile(single):
        return [single]
    raise CannotReplay(SkipReason.NO_DATA, f"--weights {path} holds neither {SAFETENSORS} nor "
                       f"{SAFETENSORS_INDEX}: give a save_pretrained folder or a .safetensors "
                       "file")


def load_parameters(path: str, param: ModuleParam) -> dict[str, torch.Tensor]:
    """The module's parameters by its own names (`self_attn.q_proj.weight`), from the weights
    named `<modulePath>.<name>` there, else `<name>`, each of the recorded shape."""
    from safetensors import safe_open
    wanted = {name: shape for name, shape in param.parameters.items() if name != "..."}
    if len(wanted) < len(param.parameters):
        raise CannotReplay(SkipReason.ARGUMENT, "op_param.json lists only the first of its "
                           "parameters: the module has too many to replay")
    prefix = f"{param.module_path}." if param.module_path else ""
    found: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        with safe_open(file, framework="pt") as f:
            keys = set(f.keys())
            for name in wanted:
                for key in (prefix + name, name):
                    if name not in found and key in keys:
                        found[name] = f.get_tensor(key)
    missing = [n for n in wanted if n not in found]
    if missing:
        raise CannotReplay(SkipReason.NO_DATA, f"--weights {path} has no "
                           f"{', '.join(prefix + n for n in missing[:5])}"
                           + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    for name, shape in wanted.items():
        if isinstance(shape, list) and list(found[name].shape) != shape:
            raise CannotReplay(SkipReason.NO_DATA, f"{prefix + name} is "
                               f"{list(found[name].shape)} in --weights, {shape} in the dump")
    return found


def model_config(weights: str, recorded: dict | None):
    """The model's config: the weights folder's config.json, else the one the dump records
    (info/model `param`); None when neither is there or transformers cannot read it."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return None
    folder = weights if os.path.isdir(weights) else os.path.dirname(weights)
    if os.path.isfile(os.path.join(folder, CONFIG)):
        config = AutoConfig.from_pretrained(folder)
    elif recorded and recorded.get("model_type"):
        doc = dict(recorded)
        config = AutoConfig.for_model(doc.pop("model_type"), **doc)
    else:
        return None
    _choose_attention(config)
    return config


def _choose_attention(config) -> None:
    """Set the attention implementation as transformers does when it builds a model from the
    config (sdpa where available): a layer built alone would get none, and run attention
    without the causal mask sdpa applies when the model passes no mask."""
    if getattr(config, "_attn_implementation", None) is not None:
        return
    try:
        from transformers import AutoModel
        with torch.device("meta"):
            AutoModel.from_config(config)
    except Exception:
        pass


def build_module(param: ModuleParam, weights: str, recorded_config: dict | None
                 ) -> torch.nn.Module:
    """The module, built and loaded with the weights, in its recorded dtype, on the CPU."""
    cls = import_class(param.cls)
    settings, leading = _extra_repr(param.extra_repr)
    kwargs = {}
    config = None
    for i, p in enumerate(list(inspect.signature(cls.__init__).parameters.values())[1:]):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if i < len(leading) and p.kind is p.POSITIONAL_OR_KEYWORD and p.name not in settings:
            settings[p.name] = leading[i]
        if p.name == "config":
            config = config or model_config(weights, recorded_config)
            if config is None:
                raise CannotReplay(SkipReason.ARGUMENT, f"{cls.__name__} is built from the "
                                   "model's config: give --weights a save_pretrained folder "
                                   "(with config.json)")
            kwargs["config"] = config
        elif p.name in _LAYER_INDEX and param.module_path.rsplit(".", 1)[-1].isdigit():
            kwargs[p.name] = int(param.module_path.rsplit(".", 1)[-1])
        elif p.name in settings:
            if isinstance(settings[p.name], Unreadable):
                raise CannotReplay(SkipReason.ARGUMENT, f"building {cls.__name__} needs "
                                   f"`{p.name}`, which extra_repr gives as "
                                   f"{settings[p.name].text[:60]}, not a value")
            kwargs[p.name] = settings[p.name]
        elif p.default is p.empty:
            raise CannotReplay(SkipReason.ARGUMENT, f"building {cls.__name__} needs `{p.name}`, "
                               "which the dump does not record")
    try:
        module = cls(**kwargs)
    except Exception as exc:
        raise CannotReplay(SkipReason.FAILED, f"{cls.__name__}({', '.join(kwargs)}) raised "
                           f"{type(exc).__name__}: {exc}") from None
    state = load_parameters(weights, param)
    own = dict(module.named_parameters())
    strange = [n for n in state if n not in own]
    if strange:
        raise CannotReplay(SkipReason.ARGUMENT, f"{cls.__name__} built here has no parameter "
                           f"{', '.join(strange[:5])}: it was built otherwise in the dump")
    unloaded = [n for n in own if n not in state]
    if unloaded:
        raise CannotReplay(SkipReason.ARGUMENT, f"{cls.__name__}({_listed(kwargs)}) built here "
                           f"has {', '.join(unloaded[:5])}, which the dump does not list: it "
                           "was built otherwise in the dump")
    shaped = [n for n in state if own[n].shape != state[n].shape]
    if shaped:
        name = shaped[0]
        raise CannotReplay(SkipReason.ARGUMENT, f"{cls.__name__}({_listed(kwargs)}) built here "
                           f"has {name} of shape {list(own[name].shape)}, the dump "
                           f"{list(state[name].shape)}: it was built otherwise in the dump")
    with torch.no_grad():
        for name, value in state.items():
            own[name].copy_(value)
    dtype = getattr(torch, param.dtype, None) if param.dtype else None
    if isinstance(dtype, torch.dtype):
        module = module.to(dtype)
    return module.eval()


def _extra_repr(text: str) -> tuple[dict, list]:
    """The `name=value` settings of an `extra_repr` whose values are Python literals, and the
    literal values it begins with before any name (none unless every one of them is one)."""
    settings, leading = {}, []
    parts = re.split(r",\s*(?=\w+=)", text)
    if parts and not re.match(r"\s*\w+=", parts[0]):
        try:
            head = ast.literal_eval(f"({parts.pop(0).strip()},)") if parts[0].strip() else ()
            leading = list(head)
        except (ValueError, SyntaxError):
            pass
    for part in parts:
        name, sep, value = part.partition("=")
        if not sep:
            continue
        value = value.strip()
        try:
            settings[name.strip()] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            # A string written without quotes (Conv's `padding_mode=reflect`), else unreadable:
            # a setting the module was built with cannot be left to its default.
            settings[name.strip()] = value if value.isidentifier() else Unreadable(value)
    return settings, leading


@dataclass(frozen=True, slots=True)
class Unreadable:
    """An `extra_repr` value that is no Python literal (`<function gelu at 0x...>`)."""

    text: str


def _listed(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k != "config")


def call_arguments(module: torch.nn.Module, param: ModuleParam, inputs: dict[str, torch.Tensor]
                   ) -> dict:
    """The keyword arguments of the recorded call (`inputs`: input file name -> tensor)."""
    from ..layout import Side, tensor_name
    if param.arguments is None:
        raise CannotReplay(SkipReason.ARGUMENT, "op_param.json does not say which argument "
                           "each input file is (no `arguments`: a dump of an older probe)")
    names = inspect.signature(module.forward).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in names.values())
    kwargs: dict = {}
    items: dict[str, dict[int, object]] = {}

    def place(label: str, value) -> None:
        if label in names:
            kwargs[label] = value
            return
        head, _, tail = label.rpartition("_")
        if head in names and tail.isdigit():
            items.setdefault(head, {})[int(tail)] = value
        elif takes_any:
            kwargs[label] = value
        else:
            raise CannotReplay(SkipReason.ARGUMENT, f"the recorded argument `{label}` is not "
                               f"one {type(module).__name__}.forward takes by name")

    for label, argument in zip(param.inputs, param.arguments):
        place(argument, inputs[tensor_name(Side.INPUT, label)])
    for name, value in param.args.items():
        if isinstance(value, str) and _UNRENDERED.search(value):
            raise CannotReplay(SkipReason.ARGUMENT, f"`{name}` was recorded as {value}, not as "
                               "a value: the module cannot be called without it (a cache "
                               "object: dump a forward without one, use_cache=False)")
        place(name, value)
    for name, found in items.items():
        if sorted(found) != list(range(len(found))):
            raise CannotReplay(SkipReason.ARGUMENT, f"the items of `{name}` are not all "
                               "recorded")
        kwargs[name] = tuple(found[i] for i in range(len(found)))
    return kwargs


def run_module(module: torch.nn.Module, kwargs: dict, float64: bool) -> list:
    """The module's outputs flattened as the probe flattens them (its output items in order),
    run in float64 (a widened copy of module and inputs) or as recorded."""
    from ..capture.tensors import flatten
    if float64:
        module = copy.deepcopy(module).to(torch.float64)
        kwargs = {k: _widen(v) for k, v in kwargs.items()}
    with torch.no_grad():
        out = module(**kwargs)
    items: list = []
    if isinstance(out, torch.Tensor):
        items.append(("", out))
    else:
        flatten(out, "", items, {}, name_items=False)
    return [t for _, t in items]


def _widen(value):
    if isinstance(value, torch.Tensor):
        return value.to(torch.float64) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_widen(v) for v in value)
    return value
