"""harness/vllm_internals.py: every use of vLLM outside its public API is listed, and present in the installed vLLM."""

import re

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


def test_a_model_whose_path_vllm_would_glob_is_given_through_a_plain_link(tmp_path, monkeypatch):
    """vLLM's loader globs a local model's path for its weights: a model in runs/export[2] had "no model weights"
    (train.py evaluate, a run's --model). loadable_model_path gives such a directory through a link of a plain name,
    the same link each time; a plain path, a hub name and a path where nothing is go as they are. (The whole path
    through vLLM: test_e2e's evaluation of a copy of the base model in such a directory.)"""
    import os

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    plain, globbed, other = tmp_path / "model", tmp_path / "export[2]", tmp_path / "export2"
    for model in (plain, globbed, other):
        model.mkdir()
    assert vllm_internals.loadable_model_path(str(plain)) == str(plain)
    for name in ("HuggingFaceTB/SmolLM2-135M-Instruct", str(tmp_path / "gone[1]")):
        assert vllm_internals.loadable_model_path(name) == name
    link = vllm_internals.loadable_model_path(str(globbed))
    assert os.path.realpath(link) == str(globbed) and link.startswith(str(tmp_path / "tmp")) and "[" not in link
    assert vllm_internals.loadable_model_path(str(globbed)) == link  # kept, not made again
    monkeypatch.chdir(tmp_path)
    assert vllm_internals.loadable_model_path("export[2]") == link  # a relative path: the same directory
    assert vllm_internals.loadable_model_path(str(other)) == str(other)
    links = os.path.dirname(link)  # another's directory (here: a link planted in its place) is not used
    os.rename(links, links + ".moved")
    os.symlink(links + ".moved", links)
    assert vllm_internals.loadable_model_path(str(globbed)) == str(globbed)


def test_every_llm_the_project_builds_gets_its_model_through_loadable_model_path():
    """Each `LLM(model=...)` of the project (and the replica's engine arguments) goes through the link above."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    built = 0
    for path in [*root.glob("*.py"), *(root / "harness").glob("*.py"), *(root / "tools").glob("*.py")]:
        text = path.read_text()
        for call in re.findall(r"LLM\(model=(?!vllm_internals\.loadable_model_path\()|\bmodel=cfg\.model\b", text):
            pytest.fail(f"{path.name}: {call} without vllm_internals.loadable_model_path")
        built += text.count("model=vllm_internals.loadable_model_path(")
    assert built == 4  # measure_with_vllm, sample_completions, the replica's engine, the generator benchmark
