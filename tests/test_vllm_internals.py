"""harness/vllm_internals.py: every use of vLLM outside its public API is listed, and present in the installed vLLM."""

import pytest

from harness import vllm_internals


def test_every_listed_internal_is_in_the_installed_vllm():
    """A vLLM upgrade that removes or renames one fails here, in one line naming it and its user."""
    gone = vllm_internals.missing()
    if gone:
        pytest.fail(gone[0] + (f" (and {len(gone) - 1} more)" if len(gone) > 1 else ""), pytrace=False)


def test_a_missing_internal_is_named_in_one_line(monkeypatch):
    """The check can fail: an entry vLLM does not have, a class attribute and an instance attribute, are named."""
    entries = (vllm_internals.Internal("vllm.v1.engine.llm_engine:LLMEngine.step_twice", "nobody"),
               vllm_internals.Internal("vllm.v1.engine.llm_engine:LLMEngine.engine_core_gone", "nobody",
                                       instance=True),
               vllm_internals.Internal("vllm.v1.engine.llm_engine:LLMEngine.step", "_Replica.run"))
    monkeypatch.setattr(vllm_internals, "INTERNALS", entries)
    gone = vllm_internals.missing()
    assert len(gone) == 2 and all("\n" not in line for line in gone)
    assert "vllm.v1.engine.llm_engine:LLMEngine.step_twice" in gone[0] and "nobody" in gone[0]
    assert "LLMEngine.engine_core_gone" in gone[1]


def test_the_project_calls_vllm_internals_only_through_the_module():
    """No module of the project calls vLLM's engine-core utilities or shuts its engine core down by hand."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for path in [*root.glob("*.py"), *(root / "harness").glob("*.py")]:
        if path.name == "vllm_internals.py":
            continue
        text = path.read_text()
        for call in ("call_utility(", "engine_core.shutdown("):
            assert call not in text, f"{path.name} calls {call} outside harness/vllm_internals.py"
