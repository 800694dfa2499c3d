"""What the call tree needs to know about modules and models, decided once per module.

A module's name, forward signature, whether it holds block lists and whether it is an element
of one (`ModuleInfo`), each as the model's code declares it (a `torch.compile` wrapper and the
class `torch.nn.utils.parametrize` swaps in are looked through), and each root module
instance's name and module paths (`Model`), kept with weak references so a round pays a
dictionary lookup per module call, not a walk of the model. `phase_of` tells a root call's
phase from its cache argument.
"""
from __future__ import annotations

import threading
import weakref

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..naming import sanitize
from ..rounds import Phase
from .arguments import forward_params
from .tokens import ModelPrompts


class ModuleInfo:
    """What the probe needs to know about one module, computed once. A `torch.compile`
    wrapper is described as the module it wraps (`wraps`): the two are one op, named as in
    the eager model, whose call is the wrapper's (its hooks run). A parametrized module (new
    style weight norm) is named by its own class (`module_class`), and what computes its
    parametrized tensors is no block list (`model_modules`)."""

    __slots__ = ("name", "params", "holds_blocks", "element", "stands_for_function", "wraps",
                 "__weakref__")

    def __init__(self, module: nn.Module):
        inner = uncompiled(module)
        self.wraps = inner if inner is not module else None
        cls = module_class(inner)
        self.name = sanitize(cls.__name__)
        # Called like the function it wraps, and taken for that call: no op of its own.
        self.stands_for_function = is_function_adapter(cls)
        self.params = forward_params(cls)
        # A block list itself, or one anywhere below: a container unless it is an element.
        self.holds_blocks = any(is_block_list(m) for m in model_modules(inner))
        self.element = False  # an element of a block list: set when its model is first seen

    @property
    def is_container(self) -> bool:
        """Whether this module, called from a container, is a container itself (SPEC §1)."""
        return self.holds_blocks and not self.element


def is_function_adapter(cls: type) -> bool:
    """Whether `cls` is a module class made to stand for a plain function: the `kernels`
    package (which transformers 5.25 installs) turns functions such as transformers'
    `apply_rotary_pos_emb` into a `Func` module whose instance replaces the function (shared by
    every caller, or a private copy per model, outside the model's module tree), so that a hub
    kernel can take its place. The probe takes a call of it for the function call it was
    before: its kernels are its caller's children, and the IDs and names of a dump do not
    depend on whether that package is installed (docs/format.md)."""
    return cls.__qualname__ == "_create_func_module.<locals>.Func"


def is_block_list(module: nn.Module) -> bool:
    """The model's repeated blocks: an `nn.ModuleList` of one or more modules (a one-layer
    draft model still has its layer list) or an `nn.Sequential` of two or more. (Not the list
    of a parametrized tensor's parametrizations: see `model_modules`.)"""
    if isinstance(module, nn.ModuleList):
        return len(module) >= 1 and not isinstance(module, parametrize.ParametrizationList)
    return isinstance(module, nn.Sequential) and len(module) >= 2


def module_class(module: nn.Module) -> type:
    """The class of `module` as the model's code made it. `torch.nn.utils.parametrize` (new
    style weight norm, spectral norm, orthogonal) gives a module whose tensor it parametrizes a
    class of its own, `Parametrized<Class>`: the module is still a `<Class>`, named as it is
    without the parametrization (an implementation that removed the weight norm, or applied
    the old hook-based one, names it so)."""
    cls = type(module)
    if not cls.__name__.startswith("Parametrized"):
        return cls  # (no attribute asked of a module whose `__getattr__` is its own)
    try:
        return parametrize.type_before_parametrizations(module)
    except Exception:
        return cls


def model_modules(module: nn.Module):
    """`module` and every module below it, except what computes a parametrized tensor: the
    `parametrizations` of a parametrized module (each a `ParametrizationList`, an
    `nn.ModuleList`) compute a weight when it is read, and are not the model's blocks."""
    stack = [module]
    while stack:
        m = stack.pop()
        yield m
        stack.extend(child for name, child in m.named_children()
                     if name != "parametrizations" or not parametrize.is_parametrized(m))


class Model:
    """One root module instance: its name, module paths, what its structure files hold and the
    prompts of its batch rows.

    `name` is the class name for the first instance of that class in the process and
    `<Class>_<k>` for later ones (SPEC §1), so two models of one class (a draft model in
    speculative decoding) never share structure files."""

    __slots__ = ("name", "first", "paths", "compiled", "prompts")

    def __init__(self, name: str, first: bool, module: nn.Module):
        self.name = name
        self.first = first    # the first model of the process: its layer files need no folder
        inner = uncompiled(module)
        # Attribute paths from the root; torch.compile wrappers are looked through, so paths
        # read as in the model's code (`model.layers.0`, not `_orig_mod.model.layers.0` nor
        # `model.layers.0._orig_mod`): a wrapper and the module it wraps have one path.
        self.paths: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.compiled = inner is not module
        self.prompts = ModelPrompts()  # its batch rows' prompts, for decode rounds' tokens.json
        for path, m in inner.named_modules():
            if _WRAPPED in path:
                path = ".".join(p for p in path.split(".") if p != _WRAPPED)
            self.paths.setdefault(m, path)
            if getattr(m, "_compiled_call_impl", None) is not None or uncompiled(m) is not m:
                self.compiled = True


_WRAPPED = "_orig_mod"  # a torch.compile wrapper's attribute for the module it wraps


def uncompiled(module: nn.Module) -> nn.Module:
    """The module a `torch.compile` wrapper (`OptimizedModule`) stands for, else `module`."""
    inner = getattr(module, _WRAPPED, None)
    return inner if isinstance(inner, nn.Module) else module


class ModelCatalog:
    """The `ModuleInfo` of every module seen and the `Model` of every root, for one probe."""

    def __init__(self):
        self._infos: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._model_counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def after_fork(self) -> None:
        """In a forked child: a lock another thread held at the fork would stay held."""
        self._lock = threading.Lock()

    def info(self, module) -> ModuleInfo:
        info = self._infos.get(module)
        if info is None:
            info = ModuleInfo(module)
            self._infos[module] = info
        return info

    def model(self, root) -> Model:
        """The `Model` of a root module instance, named and walked the first time it is seen.
        A `torch.compile` wrapper is the model it wraps: called eagerly and compiled, one module
        is one model, with one name and one model file."""
        key = uncompiled(root)
        model = self._models.get(key)
        if model is None:
            with self._lock:
                model = self._models.get(key)
                if model is None:
                    model = self._new_model(root, key)
        elif key is not root:
            model.compiled = True
        return model

    def _new_model(self, root, key: nn.Module) -> Model:
        """(Holding `_lock`.) Name a new root (`key`: the module it is, compiled or not) and
        mark the elements of its block lists."""
        cls = sanitize(module_class(key).__name__)
        count = self._model_counts.get(cls, 0)
        self._model_counts[cls] = count + 1
        model = Model(cls if count == 0 else f"{cls}_{count}", not self._models, root)
        for m in model.paths:
            if is_block_list(m):
                for element in m._modules.values():
                    if element is not None:
                        self.info(element).element = True
        self._models[key] = model
        return model


# Cache arguments, attention KV caches first, then state-space models' (Mamba's `cache_params`,
# `inference_params` of mamba_ssm).
_CACHE_PARAMS = ("past_key_values", "past_key_value", "kv_cache", "cache", "layer_past", "past",
                 "cache_params", "inference_params", "mamba_cache_params")


def phase_of(params: tuple, args: tuple, kwargs: dict) -> Phase:
    """Prefill, Decoder (a cache that already holds state came in) or Forward (no cache
    argument)."""
    positional, _, ordered = params
    name = next((n for n in _CACHE_PARAMS if n in ordered), None)
    if name is None:
        return Phase.FORWARD
    if name in kwargs:
        value = kwargs[name]
    elif name in positional and positional.index(name) < len(args):
        value = args[positional.index(name)]
    else:
        value = None
    return Phase.DECODER if _has_content(value) else Phase.PREFILL


# What a cache object says of its content, asked in this order; the first that answers decides:
# the tokens an attention cache holds (transformers' `Cache.get_seq_length`, which raises for a
# cache of state-space layers only), whether state-space layers hold state from earlier tokens
# (`has_previous_state`: a method of transformers' `Cache`, a flag of older hybrid caches), the
# tokens a mamba_ssm `InferenceParams` has seen. The values in a cache's tensors are no signal:
# a state may hold zeros, and a preallocated cache holds memory before it holds tokens.
_CONTENT_SIGNALS = ("get_seq_length", "has_previous_state", "seqlen_offset")


def _has_content(cache) -> bool:
    """Whether `cache` holds state from earlier tokens (see `_CONTENT_SIGNALS`). A cache that
    offers a signal but answers none (no layers yet) is empty; an object that offers none is
    taken to hold state, tensors and sequences of them hold state when not empty."""
    if cache is None:
        return False
    offered = False
    for name in _CONTENT_SIGNALS:
        value = getattr(cache, name, None)
        if value is None:
            continue
        offered = True
        try:
            value = value() if callable(value) else value
            if isinstance(value, (int, bool)):
                return value > 0
        except Exception:  # no layer of the kind this signal asks (transformers' Cache raises)
            continue
    if offered:
        return False
    if isinstance(cache, torch.Tensor):
        return cache.numel() > 0
    if isinstance(cache, (tuple, list)):
        return any(_has_content(c) for c in cache)
    return True
