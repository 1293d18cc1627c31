"""The house plan, measured: the recipe in front (the card's nine files at the root, train.py's loop near its top),
everything a reader may skip in one package beside them (harness/), no function or class outgrows a screen-read, and
imports flow one way: the algorithm files are leaves, the flags know the loss files by name only, and nothing calls
back into train.py.

    python tests/test_layout.py     prints the counts these tests check
"""

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RECIPE_FILES = ("train.py", "pipeline_rl.py")
# The root's Python files are the card's nine: the recipe a reader came for; all else is in the package harness/
CARD_FILES = ("grpo.py", "dapo.py", "drgrpo.py", "gspo.py", "cispo.py", "tis.py", "pipeline_rl.py", "scaling_fit.py",
              "train.py")
PACKAGE = "harness"
RUNTIME_FILES = tuple(f"{PACKAGE}/{name}.py" for name in ("flags", "checkpoints", "runtime", "packing", "head_gemm",
                                                           "vllm_replica", "cli", "wire"))
ENTRY_POINTS = (f"{PACKAGE}.bench", f"{PACKAGE}.teach")  # beside tests/, the only modules that may import train.py
ALGORITHM_FILES = ("grpo", "dapo", "drgrpo", "gspo", "cispo", "tis")  # one algorithm each: torch only
# train.py has no line budget: it is as long as the recipe's steps and the records the loss sees need (issue 54)
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
    """The root's modules by name (train), the package's by dotted name (harness.flags)."""
    package = [f"{PACKAGE}.{p.stem}" for p in (REPO / PACKAGE).glob("*.py") if p.stem != "__init__"]
    return sorted([p.stem for p in REPO.glob("*.py")] + package)


def module_file(module: str) -> str:
    return module.replace(".", "/") + ".py"


def imported_project_modules(name: str) -> set[str]:
    """Project modules that `name` (a file) imports anywhere: at the top, inside a function, or by importlib with a
    literal. `from harness import flags` and `from harness.flags import Args` both import harness.flags."""
    ours = set(project_modules())
    found = set()
    for node in ast.walk(parsed(name)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names} | {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module, node.module.split(".")[0]} | {f"{node.module}.{a.name}" for a in node.names}
    return (found & ours) - {name[:-len(".py")].replace("/", ".")}


def test_the_root_holds_the_cards_files_and_the_package_the_rest() -> None:
    """The root's Python files are exactly the card's nine; the package says what it is and lists its modules."""
    assert sorted(p.name for p in REPO.glob("*.py")) == sorted(CARD_FILES)
    init = (REPO / PACKAGE / "__init__.py").read_text()
    modules = sorted(p.stem for p in (REPO / PACKAGE).glob("*.py") if p.stem != "__init__")
    assert init.startswith('"""') and [m for m in modules if f"{m} " not in init] == [], "harness/__init__.py's list"


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
    graph = {m: imported_project_modules(module_file(m)) for m in project_modules()}
    importers_of_train = sorted(m for m, deps in graph.items() if "train" in deps)
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


# The generator's scheduler, made of objects that own their state; records are the data they pass each other.
SCHEDULER_PARTS = ("_DataStream", "_GroupTable", "_ReplicaPool", "_ReplicaFaults", "_Admission", "_Rewards",
                   "_BatchChoice", "_Scheduler")
SCHEDULER_RECORDS = ("_GroupState", "_ReplicaSlot")


def _assigned_pairs(node: ast.AST) -> list[tuple[ast.expr, ast.expr | None]]:
    """(target, value) of an assignment, tuples unpacked pairwise (`self.a, self.b = a, b`)."""
    if isinstance(node, ast.Assign):
        targets, value = node.targets, node.value
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets, value = [node.target], node.value
    else:
        return []
    pairs = []
    for target in targets:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            pairs += zip(target.elts, value.elts)
        elif isinstance(target, ast.Tuple):
            pairs += [(t, None) for t in target.elts]
        else:
            pairs.append((target, value))
    return pairs


def _self_attribute(node: ast.AST) -> str | None:
    is_self = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
    return node.attr if is_self else None


def state_sharing(tree: ast.Module, parts: tuple[str, ...], records: tuple[str, ...]) -> list[str]:
    """Where a class of the scheduler reads state that another class sets: a part reading a `self.X` that it neither
    assigns nor defines (a mixin's read), a part or record assigning an attribute of another object, a part reading
    a data attribute of another part (`self.pool.replicas`, `pool.replicas`: a part's interface is its methods), a
    part that inherits or hands itself to another."""
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    missing = [name for name in (*parts, *records) if name not in classes]
    if missing:
        return [f"no class {name}" for name in missing]
    methods = {name: {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
               for name, cls in classes.items()}
    problems = []
    for name in (*parts, *records):
        cls = classes[name]
        owned = set(methods[name]) | {t.id for n in cls.body for t, _ in _assigned_pairs(n) if isinstance(t, ast.Name)}
        holds: dict[str, str] = {}  # the attributes (self.X) and parameters that hold another part: X -> its class
        for function in (n for n in ast.walk(cls) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            params = {a.arg: a.annotation.id for a in function.args.args + function.args.kwonlyargs
                      if isinstance(a.annotation, ast.Name) and a.annotation.id in parts}
            for node in ast.walk(function):
                for target, value in _assigned_pairs(node):
                    if isinstance(target, ast.Attribute) and _self_attribute(target) is None:
                        problems.append(f"{name}.{function.name} sets {ast.unparse(target)}, another object's")
                    attr = _self_attribute(target)
                    if attr is None:
                        continue
                    owned.add(attr)
                    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in parts:
                        holds[attr] = value.func.id
                    elif isinstance(value, ast.Name) and value.id in params:
                        holds[attr] = params[value.id]
            for node in ast.walk(function):  # a part-typed parameter: only its methods
                if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                        and isinstance(node.value, ast.Name) and node.value.id in params
                        and node.attr not in methods[params[node.value.id]]):
                    problems.append(f"{name}.{function.name} reads {ast.unparse(node)}, not a method of "
                                    f"{params[node.value.id]}")
        if name in records:
            continue
        if cls.bases:
            problems.append(f"{name} inherits from {', '.join(ast.unparse(b) for b in cls.bases)}: a mixin")
        for node in ast.walk(cls):
            attr = _self_attribute(node)
            if attr is not None and attr not in owned:
                problems.append(f"{name} reads self.{attr}, which it never sets")
            held = _self_attribute(node.value) if isinstance(node, ast.Attribute) else None
            if held in holds and isinstance(node.ctx, ast.Load) and node.attr not in methods[holds[held]]:
                problems.append(f"{name} reads {ast.unparse(node)}, not a method of {holds[held]}")
            if isinstance(node, ast.Call) and any(isinstance(a, ast.Name) and a.id == "self" for a in node.args):
                problems.append(f"{name} hands itself to {ast.unparse(node.func)}")
    return problems


def test_no_class_of_the_scheduler_reads_state_that_another_sets() -> None:
    """Issue 54's done-when line, as far as the source shows it: the scheduler's parts are objects that own their
    state and call each other's methods; the records they pass change only through their own methods."""
    problems = state_sharing(parsed("pipeline_rl.py"), SCHEDULER_PARTS, SCHEDULER_RECORDS)
    assert not problems, "pipeline_rl.py: " + "; ".join(problems)


def test_the_algorithm_files_are_leaves() -> None:
    """grpo.py ... tis.py import torch and nothing of the project, not even each other."""
    for name in ALGORITHM_FILES:
        assert not imported_project_modules(name + ".py"), f"{name}.py imports {imported_project_modules(name + '.py')}"


def test_a_flag_passes_each_file_once() -> None:
    """--loss goes from train.py to the loss file: train.py hands its loss table (LOSSES) to harness/flags.py, which
    reads the files' signatures but imports none of them, and harness/runtime.py never calls back into train.py:
    set_up takes the flags only, and train.py builds its learner and hands it to Setup.begin."""
    flags_imports = imported_project_modules(f"{PACKAGE}/flags.py")
    assert not flags_imports & set(ALGORITHM_FILES), flags_imports
    assert "train" not in imported_project_modules(f"{PACKAGE}/runtime.py")
    set_up = next(node for node in parsed(f"{PACKAGE}/runtime.py").body if isinstance(node, ast.FunctionDef)
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
    mixins = """
class _Pool:
    def __init__(self):
        self.replicas = {}
    def loads(self):
        return self.groups
class _Admission:
    def __init__(self, pool: _Pool):
        self.pool = pool
        self.pool.busy = 1
    def admit(self, other: _Pool):
        return self.pool.replicas, other.replicas, self.pool.loads(), _Pool.helper(self)
class _Scheduler(_Pool, _Admission):
    pass
class _Slot:
    def die(self, group: _Pool):
        group.x = 1
"""
    found = state_sharing(ast.parse(mixins), ("_Pool", "_Admission", "_Scheduler"), ("_Slot",))
    assert found == ["_Pool reads self.groups, which it never sets",
                     "_Admission.__init__ sets self.pool.busy, another object's",
                     "_Admission.admit reads other.replicas, not a method of _Pool",
                     "_Admission reads self.pool.replicas, not a method of _Pool",
                     "_Admission hands itself to _Pool.helper",
                     "_Scheduler inherits from _Pool, _Admission: a mixin",
                     "_Slot.die sets group.x, another object's"], found


if __name__ == "__main__":
    for name, row in counts().items():
        kind_def, kind_class = row["longest_def"], row["longest_class"]
        firsts = {f: row["first_line"][f] for (n, f) in MAX_FIRST_LINE if n == name}
        print(f"{name:24} {row['lines']:5} lines  longest def {kind_def[1]} ({kind_def[3]})"
              + (f"  longest class {kind_class[1]} ({kind_class[3]})" if kind_class else "")
              + "".join(f"  def {f}( at line {line}" for f, line in firsts.items()))
    sys.exit(0)
