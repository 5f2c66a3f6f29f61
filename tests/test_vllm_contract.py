"""The vllm engine's contract with vLLM: ``VLLM_CONTRACT`` names every vLLM callable and keyword the engine uses
(checked here by reading the engine's own source, everywhere), and every one of them exists in the installed vLLM
(checked wherever vLLM imports: a GPU node with the ``gpu`` extra)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import typing
from pathlib import Path

import pytest

from actor import vllm_engine
from actor.vllm_engine import LOGPROBS_MODE, VLLM_CONTRACT

SOURCE = ast.parse(Path(vllm_engine.__file__).read_text())


def _declared(suffix: str) -> tuple[str, ...]:
    [key] = [k for k in VLLM_CONTRACT if k.endswith(suffix)]
    return VLLM_CONTRACT[key]


def _calls(attr_chain: str) -> list[ast.Call]:
    """Calls whose function is written ``attr_chain`` (e.g. ``self.llm.generate``)."""
    return [n for n in ast.walk(SOURCE) if isinstance(n, ast.Call) and ast.unparse(n.func) == attr_chain]


def test_the_contract_names_every_vllm_call_and_keyword_in_the_engine():
    llm_methods = {n.func.attr for n in ast.walk(SOURCE)
                   if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                   and ast.unparse(n.func.value) == "self.llm"}
    declared = {k.rsplit(".", 1)[1] for k in VLLM_CONTRACT if ".AsyncLLM." in k}
    assert llm_methods and llm_methods <= declared, llm_methods - declared
    for name in llm_methods:
        for call in _calls(f"self.llm.{name}"):
            assert {k.arg for k in call.keywords} <= set(_declared(f"AsyncLLM.{name}")), (name, ast.unparse(call))
    sampling = _calls("self.vllm.SamplingParams")
    assert sampling and {k.arg for c in sampling for k in c.keywords} <= set(_declared("vllm.SamplingParams"))
    prompts = _calls("TokensPrompt")
    assert prompts and {k.arg for c in prompts for k in c.keywords} <= set(_declared("TokensPrompt"))
    # engine_args builds a dict literal (and adds keys by subscript): every key must be AsyncEngineArgs'
    fn = next(n for n in ast.walk(SOURCE) if isinstance(n, ast.FunctionDef) and n.name == "engine_args")
    keys = {k.value for d in ast.walk(fn) if isinstance(d, ast.Dict) for k in d.keys if isinstance(k, ast.Constant)}
    keys |= {s.slice.value for s in ast.walk(fn) if isinstance(s, ast.Subscript) and isinstance(s.slice, ast.Constant)
             and ast.unparse(s.value) == "args"}
    assert keys and keys <= set(_declared("AsyncEngineArgs")), keys - set(_declared("AsyncEngineArgs"))


def _resolve(dotted: str):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _accepted(obj) -> set[str]:
    # a TypedDict's keys: typing's and typing_extensions' (vLLM 0.32's TokensPrompt, which typing.is_typeddict
    # does not recognise on Python 3.11) both list them here
    if isinstance(obj, type) and hasattr(obj, "__required_keys__"):
        return set(obj.__required_keys__) | set(obj.__optional_keys__)
    fields = getattr(obj, "__struct_fields__", None) or getattr(obj, "__dataclass_fields__", None)
    if fields:
        return set(fields)
    return set(inspect.signature(obj).parameters)


def test_the_accepted_names_of_a_typed_dict_are_its_keys_whichever_typing_made_it():
    import typing_extensions

    class Plain(typing.TypedDict, total=False):
        prompt_token_ids: list

    class Extended(typing_extensions.TypedDict):
        prompt_token_ids: list
        multi_modal_data: typing_extensions.NotRequired[dict]

    assert _accepted(Plain) == {"prompt_token_ids"}
    assert _accepted(Extended) == {"prompt_token_ids", "multi_modal_data"}
    assert _accepted(lambda a, *, b=1: None) == {"a", "b"}


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (the gpu extra)")
@pytest.mark.parametrize("name", sorted(VLLM_CONTRACT))
def test_the_installed_vllm_has_every_name_and_keyword(name):
    obj = _resolve(name)
    missing = set(VLLM_CONTRACT[name]) - _accepted(obj)
    assert not missing, f"{name} no longer accepts {sorted(missing)}"
    if name.endswith("AsyncLLM.generate"):  # called positionally: the order matters too
        assert list(inspect.signature(obj).parameters)[1:4] == list(VLLM_CONTRACT[name])
        assert inspect.isasyncgenfunction(obj), "the engine closes its streams with contextlib.aclosing"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (the gpu extra)")
def test_the_installed_vllm_knows_the_logprobs_mode():
    from vllm.config.model import LogprobsMode

    assert LOGPROBS_MODE in typing.get_args(LogprobsMode)
