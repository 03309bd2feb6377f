"""The runtime's shape: one home for the verify step (`hf_diffspec/runtime/verifier.py`), functions that fit on a
screen, and no module state that a call writes (what a call keeps lives in its context or on the target)."""

import ast
import collections
import contextvars
import importlib
import logging
import pathlib
import re
import threading

import torch

from hf_diffspec import runtime
from helpers import random_ids, run_in_threads, tiny_drafter, tiny_dual_drafter, tiny_hybrid_target, tiny_target

RUNTIME = pathlib.Path(runtime.__file__).parent
MAX_FUNCTION_LINES = 60


def test_no_runtime_function_is_longer_than_a_screen():
    long = [f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in sorted(RUNTIME.glob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long


def test_one_function_creates_the_target_cache_and_one_module_builds_attention_masks():
    sources = {path.name: path.read_text() for path in RUNTIME.glob("*.py")}
    creating = {name for name, text in sources.items() if re.search(r"StaticCache\(|DynamicCache\(config", text)}
    assert creating == {"verify_cache.py"}
    masking = {name for name, text in sources.items() if "finfo(" in text}  # an additive mask's blocked value
    assert masking == {"verify_inputs.py"}


def _state(value):
    """What a call could change in a module global: containers' contents (deques too), tensors' storage, shape and
    version counter, objects' and classes' attributes (`__slots__` too), a context variable's value and a
    thread-local's attributes as this thread sees them, and `functools` caches' sizes (functions, modules, loggers and
    synchronisation primitives are not state). Not seen: what other threads see in a thread-local or another
    context sees in a context variable, and the cells of closures."""
    if hasattr(value, "cache_info"):
        return ("cache", value.cache_info().currsize)
    if isinstance(value, torch.Tensor):
        return ("tensor", value.data_ptr(), tuple(value.shape), value.dtype, value._version)
    if isinstance(value, contextvars.ContextVar):
        return ("context variable", repr(value.get("<unset>")))
    if isinstance(value, threading.local):
        return ("thread-local", repr(vars(value)))
    if isinstance(value, (dict, list, set, tuple, frozenset, collections.deque)):
        return repr(value)
    slots = [name for cls in type(value).__mro__ for name in getattr(cls, "__slots__", ())]
    if slots and not isinstance(value, type):
        return repr({name: getattr(value, name, "<unset>") for name in slots})
    if isinstance(value, type):
        return repr({k: v for k, v in vars(value).items() if not k.startswith("__") and not callable(v)
                     and not isinstance(v, (property, staticmethod, classmethod))})
    if callable(value) or isinstance(value, (type(threading.Lock()), type(threading.RLock()), logging.Logger)):
        return None
    if hasattr(value, "__dict__") and not isinstance(value, type(runtime)):
        return repr(vars(value))
    return None


def _module_state() -> dict:
    modules = [importlib.import_module(f"hf_diffspec.runtime.{path.stem}") for path in sorted(RUNTIME.glob("*.py"))
               if path.stem != "__init__"]
    return {f"{module.__name__}.{name}": _state(value) for module in modules for name, value in vars(module).items()
            if not name.startswith("__")}


def test_speculative_calls_write_no_module_global():
    """Chains, trees, D²SD, a hybrid target, sampling, calls in threads at once, first calls (a profile measured and
    gates learned) and later ones: every runtime module's globals are as they were before."""
    llama, hybrid = tiny_target("llama", seed=5), tiny_hybrid_target("qwen3_5", seed=5)
    calls = [(llama, tiny_drafter(llama, block_size=4, seed=5), {}),
             (llama, tiny_drafter(llama, block_size=5, seed=6, draft_tree_budget=6), {}),
             (llama, tiny_dual_drafter(llama, block_size=4, seed=7, num_branches=2, tree_budget=8), {}),
             (hybrid, tiny_drafter(hybrid, block_size=4, seed=5), dict(do_sample=True, temperature=0.9)),
             (llama, tiny_drafter(llama, block_size=4, seed=8), dict(prompt_lookup_num_tokens=3))]
    _module_state()  # every module imported before the snapshot
    before = _module_state()
    for _ in range(2):  # first calls, then calls that start from what the first ones kept
        run_in_threads([lambda t=target, d=drafter, kw=kwargs: t.generate(
            random_ids(5, 8, rows=2), attention_mask=torch.ones(2, 8, dtype=torch.long), assistant_model=d,
            max_new_tokens=12, **{"do_sample": False, **kw}) for target, drafter, kwargs in calls])
    after = _module_state()
    assert {k: (before[k], after.get(k)) for k in before if before[k] != after.get(k)} == {}
    assert set(after) == set(before)
