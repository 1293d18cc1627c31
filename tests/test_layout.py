"""The house plan, measured: the recipe in front (train.py's loop near its top), the runtime in modules a reader may
skip, no function or class outgrows a screen-read, and imports flow one way: the algorithm files are leaves, the
flags know the loss files by name only, and nothing calls back into train.py.

    python tests/test_layout.py     prints the counts these tests check
"""

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RECIPE_FILES = ("train.py", "pipeline_rl.py")
RUNTIME_FILES = ("flags.py", "checkpoints.py", "runtime.py", "packing.py", "head_gemm.py", "vllm_replica.py",
                 "cli.py")
ENTRY_POINTS = ("bench.py", "teach.py")  # beside tests/, the only modules that may import train.py
ALGORITHM_FILES = ("grpo", "dapo", "drgrpo", "gspo", "cispo", "tis")  # one algorithm each: torch only
# train.py has no line budget: it is as long as the recipe's steps and the records the loss sees need (issue 54)
MAX_LINES = {"pipeline_rl.py": 1550}  # pipeline_rl.py: + per-completion seeds, reward deadlines
MAX_FIRST_LINE = {("train.py", "train"): 200, ("pipeline_rl.py", "admission_allowed"): 300}
MAX_FUNCTION_LINES = 100
MAX_CLASS_LINES = 300


def parsed(name: str) -> ast.Module:
    return ast.parse((REPO / name).read_text(), filename=name)


def spans(tree: ast.Module) -> list[tuple[str, str, int, int]]:
    """(kind, qualified name, first line, lines) of every function and class, nested ones included."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                kind = "class" if isinstance(child, ast.ClassDef) else "def"
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                found.append((kind, prefix + child.name, child.lineno, child.end_lineno - first + 1))
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def project_modules() -> list[str]:
    return sorted(p.stem for p in REPO.glob("*.py"))


def imported_project_modules(name: str) -> set[str]:
    """Project modules that `name` imports anywhere: at the top, inside a function, or by importlib with a literal."""
    ours = set(project_modules())
    found = set()
    for node in ast.walk(parsed(name)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return (found & ours) - {Path(name).stem}


def counts() -> dict[str, dict]:
    table = {}
    for name in (*RECIPE_FILES, *RUNTIME_FILES):
        if not (REPO / name).exists():
            continue
        tree = parsed(name)
        found = spans(tree)
        longest = {kind: max((s for s in found if s[0] == kind), key=lambda s: s[3], default=None)
                   for kind in ("def", "class")}
        table[name] = {"lines": len((REPO / name).read_text().splitlines()),
                       "first_line": {n: line for kind, n, line, _ in found if kind == "def"},
                       "longest_def": longest["def"], "longest_class": longest["class"]}
    return table


def test_the_recipe_files_fit_their_budgets() -> None:
    table = counts()
    for name, limit in MAX_LINES.items():
        assert table[name]["lines"] <= limit, f"{name} has {table[name]['lines']} lines (at most {limit})"
    for (name, function), limit in MAX_FIRST_LINE.items():
        line = table[name]["first_line"][function]
        assert line <= limit, f"{name}: def {function}( at line {line} (within the first {limit})"


def test_train_py_is_mostly_recipe() -> None:
    """At least half of train.py is the bodies of its functions and classes: not flags, docstring or imports."""
    tree = parsed("train.py")
    body_lines = sum(s[3] for s in spans(tree) if "." not in s[1])
    total = len((REPO / "train.py").read_text().splitlines())
    assert body_lines >= total / 2, f"train.py: {body_lines} of {total} lines are its functions and classes"


@pytest.mark.parametrize("name", [*RECIPE_FILES, *RUNTIME_FILES])
def test_no_function_or_class_outgrows_a_reading(name: str) -> None:
    if not (REPO / name).exists():
        pytest.fail(f"{name} is named in the layout but missing")
    too_long = [f"{kind} {qualified} (line {line}): {lines} lines" for kind, qualified, line, lines in spans(parsed(name))
                if lines > (MAX_CLASS_LINES if kind == "class" else MAX_FUNCTION_LINES)]
    assert not too_long, f"{name}: " + "; ".join(too_long)


def test_imports_flow_one_way() -> None:
    """No cycles among the project's modules, and only the entry points (and tests) import train.py."""
    graph = {m: imported_project_modules(m + ".py") for m in project_modules()}
    importers_of_train = sorted(m + ".py" for m, deps in graph.items() if "train" in deps)
    assert set(importers_of_train) <= set(ENTRY_POINTS), f"train.py is imported by {importers_of_train}"
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(module):], module]))
        if module in done:
            return
        for dep in sorted(graph[module]):
            visit(dep, [*path, module])
        done.add(module)

    for module in graph:
        visit(module, [])


def test_the_algorithm_files_are_leaves() -> None:
    """grpo.py ... tis.py import torch and nothing of the project, not even each other."""
    for name in ALGORITHM_FILES:
        assert not imported_project_modules(name + ".py"), f"{name}.py imports {imported_project_modules(name + '.py')}"


def test_a_flag_passes_each_file_once() -> None:
    """--loss goes from train.py to the loss file: flags.py names the loss files (LOSSES) and reads their
    hyper-parameters from source, but imports none of them, and runtime.py never calls back into train.py: set_up
    takes the flags only, and train.py builds its learner and hands it to Setup.begin."""
    assert not imported_project_modules("flags.py") & set(ALGORITHM_FILES), imported_project_modules("flags.py")
    assert "train" not in imported_project_modules("runtime.py")
    set_up = next(node for node in parsed("runtime.py").body if isinstance(node, ast.FunctionDef)
                  and node.name == "set_up")
    assert [a.arg for a in set_up.args.args] == ["args"], "runtime.set_up takes a callback again"


def test_no_function_in_train_py_takes_more_than_six_parameters() -> None:
    """The loop's steps pass records (Learner, Step, LossInputs, Aggregation), not long argument lists."""
    too_many = []
    for node in ast.walk(parsed("train.py")):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            is_method = bool(a.args) and a.args[0].arg in ("self", "cls")
            count = len(a.posonlyargs + a.args + a.kwonlyargs) - is_method
            if count > 6:
                too_many.append(f"{node.name} ({count})")
    assert not too_many, "train.py: " + ", ".join(too_many)


def test_the_checks_here_catch_what_they_look_for() -> None:
    """The measures above on made-up source: a long function, a long class and a nested function are all seen."""
    source = "class A:\n" + "    x = 1\n" * 301 + "def f():\n    def g():\n" + "        pass\n" * 101
    found = {(kind, name): lines for kind, name, _, lines in spans(ast.parse(source))}
    assert found[("class", "A")] == 302
    assert found[("def", "f.g")] == 102 and found[("def", "f")] == 103


if __name__ == "__main__":
    for name, row in counts().items():
        kind_def, kind_class = row["longest_def"], row["longest_class"]
        firsts = {f: row["first_line"][f] for (n, f) in MAX_FIRST_LINE if n == name}
        print(f"{name:16} {row['lines']:5} lines  longest def {kind_def[1]} ({kind_def[3]})"
              + (f"  longest class {kind_class[1]} ({kind_class[3]})" if kind_class else "")
              + "".join(f"  def {f}( at line {line}" for f, line in firsts.items()))
    sys.exit(0)
