"""The house plan, measured: the recipe in front (the card's nine files at the root, train.py's loop near its top),
what it stands on in one package beneath it (harness/), the tools that run it above both (tools/), and imports that
say so. The layers are rules on who may import whom, checked on every import in a file, a function's lazy one
included: no harness module imports the recipe (train, pipeline_rl, scaling_fit), nothing beneath the tools imports
them, the loss files import torch and the standard library only, nothing calls back into train.py but the tools, and
no import cycle forms. Files are as long as their one component needs: no line budget on a file; a function stays
under a reading (the developers' guide's 100 lines).

    python tests/test_layout.py     prints the layers' imports and the counts these tests check
"""

import ast
import sys
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parent.parent
RECIPE_FILES = ("train.py", "pipeline_rl.py")
# The root's Python files are the card's nine: the recipe a reader came for; what it stands on is in harness/
CARD_FILES = ("grpo.py", "dapo.py", "drgrpo.py", "gspo.py", "cispo.py", "tis.py", "pipeline_rl.py", "scaling_fit.py",
              "train.py")
PACKAGE = "harness"  # beneath the recipe
TOOLS = "tools"  # above the recipe and the harness: what runs the recipe and reads its runs
ALGORITHM_FILES = ("grpo", "dapo", "drgrpo", "gspo", "cispo", "tis")  # one algorithm each: torch only
RECIPE_MODULES = ("train", "pipeline_rl", "scaling_fit")  # the root's modules no harness module may import
LOSS_FILE_IMPORTS = frozenset({"torch", *sys.stdlib_module_names})  # typing and __future__ are standard library
# The loop and the rule on the first screens of their files: reading order, not a size
MAX_FIRST_LINE = {("train.py", "train"): 200, ("pipeline_rl.py", "admission_allowed"): 300}
MAX_FUNCTION_LINES = 100


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


def package_files(package: str) -> list[str]:
    """A package's modules as files (harness/flags.py), its __init__.py left out."""
    return sorted(f"{package}/{p.name}" for p in (REPO / package).glob("*.py") if p.stem != "__init__")


def project_modules() -> list[str]:
    """The root's modules by name (train), the packages' by dotted name (harness.flags, tools.bench)."""
    return sorted([p.stem for p in REPO.glob("*.py")] + [module_name(f) for f in package_files(PACKAGE)]
                  + [module_name(f) for f in package_files(TOOLS)])


def module_file(module: str) -> str:
    return module.replace(".", "/") + ".py"


def module_name(file: str) -> str:
    return file[:-len(".py")].replace("/", ".")


def imports(tree: ast.Module, module: str) -> list[tuple[str, int]]:
    """(module, line) for every import in `tree`, the source of `module`: at the top or inside a function, relative
    ones resolved, and importlib.import_module or __import__ with a literal name. Each dotted name comes with its
    parents (`import a.b` imports a and a.b), and `from a import b` names a and a.b (b may be a module)."""
    found = []

    def add(name: str, line: int) -> None:
        parts = name.split(".")
        found.extend((".".join(parts[:i]), line) for i in range(1, len(parts) + 1))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x: relative to the package `module` is in
                package = module.split(".")[:-node.level]
                base = ".".join([*package, *([base] if base else [])])
            if base:
                add(base, node.lineno)
            for alias in node.names:
                if alias.name != "*":
                    add(f"{base}.{alias.name}" if base else alias.name, node.lineno)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            called = ast.unparse(node.func)
            if called in ("importlib.import_module", "import_module", "__import__"):
                add(node.args[0].value, node.lineno)
    return sorted(set(found), key=lambda item: (item[1], item[0]))  # in line order (ast.walk goes breadth first)


def imported_project_modules(name: str) -> set[str]:
    """Project modules that `name` (a file) imports anywhere (`imports`). `from harness import flags` and
    `from harness.flags import Args` both import harness.flags."""
    module = module_name(name)
    return ({found for found, _ in imports(parsed(name), module)} & set(project_modules())) - {module}


def beneath_the_recipe(module: str, tree: ast.Module) -> list[str]:
    """A harness module's imports of the recipe (train, pipeline_rl, scaling_fit): the harness lies beneath it."""
    if module.split(".")[0] != PACKAGE:
        return []
    return [f"{module} imports {name} (line {line})" for name, line in imports(tree, module) if name in RECIPE_MODULES]


def beneath_the_tools(module: str, tree: ast.Module) -> list[str]:
    """A root or harness module's imports of the tools: they stand on top of both."""
    if module.split(".")[0] == TOOLS:
        return []
    deepest: dict[int, str] = {}  # `from tools import bench` names tools and tools.bench: say tools.bench
    for name, line in imports(tree, module):
        if name.split(".")[0] == TOOLS and len(name) > len(deepest.get(line, "")):
            deepest[line] = name
    return [f"{module} imports {name} (line {line})" for line, name in sorted(deepest.items())]


def loss_file_imports(module: str, tree: ast.Module) -> list[str]:
    """A loss file's imports of anything but torch and the standard library (the project, numpy, each other)."""
    if module not in ALGORITHM_FILES:
        return []
    return [f"{module} imports {name} (line {line})" for name, line in imports(tree, module)
            if "." not in name and name not in LOSS_FILE_IMPORTS]


def layer_problems(rule: Callable[[str, ast.Module], list[str]]) -> list[str]:
    """`rule`'s findings over every module of the project: the root's, the harness's and the tools' (their
    __init__.py too, as PACKAGE.__init__, so that a relative import there resolves inside the package)."""
    files = [p.name for p in REPO.glob("*.py")] + [f"{package}/{p.name}" for package in (PACKAGE, TOOLS)
                                                   for p in (REPO / package).glob("*.py")]
    found = []
    for file in sorted(files):
        found += rule(module_name(file), parsed(file))
    return found


def test_the_root_holds_the_cards_files_and_the_packages_the_rest() -> None:
    """The root's Python files are exactly the card's nine; each package says what it is and lists its modules."""
    assert sorted(p.name for p in REPO.glob("*.py")) == sorted(CARD_FILES)
    for package in (PACKAGE, TOOLS):
        init = (REPO / package / "__init__.py").read_text()
        modules = [module_name(f).split(".")[1] for f in package_files(package)]
        assert init.startswith('"""') and [m for m in modules if f"{m} " not in init] == [], f"{package}/__init__.py"


def test_the_harness_lies_beneath_the_recipe() -> None:
    """No harness module imports train, pipeline_rl or scaling_fit, anywhere in its file (the loss files, which
    import only torch, may be read)."""
    problems = layer_problems(beneath_the_recipe)
    assert not problems, "; ".join(problems)


def test_nothing_beneath_the_tools_imports_them() -> None:
    """The tools (tools/: bench, experiments, teach) run the recipe: no root or harness module imports them."""
    problems = layer_problems(beneath_the_tools)
    assert not problems, "; ".join(problems)


def test_the_loss_files_import_only_torch() -> None:
    """grpo.py ... tis.py import torch and the standard library: nothing of the project, not even each other."""
    problems = layer_problems(loss_file_imports)
    assert not problems, "; ".join(problems)


def counts() -> dict[str, dict]:
    table = {}
    for name in (*RECIPE_FILES, *package_files(PACKAGE)):
        found = spans(parsed(name))
        longest = {kind: max((s for s in found if s[0] == kind), key=lambda s: s[3], default=None)
                   for kind in ("def", "class")}
        table[name] = {"lines": len((REPO / name).read_text().splitlines()),
                       "first_line": {n: line for kind, n, line, _ in found if kind == "def"},
                       "longest_def": longest["def"], "longest_class": longest["class"]}
    return table


def test_the_loop_and_the_rule_come_first() -> None:
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


@pytest.mark.parametrize("name", [p.name for p in sorted(REPO.glob("*.py"))] + package_files(PACKAGE))
def test_no_function_outgrows_a_reading(name: str) -> None:
    too_long = [f"def {qualified} (line {line}): {lines} lines" for kind, qualified, line, lines in spans(parsed(name))
                if kind == "def" and lines > MAX_FUNCTION_LINES]
    assert not too_long, f"{name}: " + "; ".join(too_long)


def test_imports_flow_one_way() -> None:
    """No cycles among the project's modules, and only the tools (and tests) import train.py."""
    graph = {m: imported_project_modules(module_file(m)) for m in project_modules()}
    importers_of_train = sorted(m for m, deps in graph.items() if "train" in deps)
    assert all(m.startswith(f"{TOOLS}.") for m in importers_of_train), f"train.py is imported by {importers_of_train}"
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
SCHEDULER_PARTS = ("_DataStream", "_GroupTable", "_ReplicaFaults", "_Admission", "_Rewards", "_BatchChoice",
                   "_Scheduler")
SCHEDULER_RECORDS = ("_GroupState",)
# beneath it, the replica fleet (harness/fleet.py): the pool of replicas and the slot it keeps for each
FLEET_PARTS, FLEET_RECORDS = ("ReplicaPool",), ("ReplicaSlot",)


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
    problems = state_sharing(parsed(f"{PACKAGE}/fleet.py"), FLEET_PARTS, FLEET_RECORDS)
    assert not problems, "harness/fleet.py: " + "; ".join(problems)


# What the replica fleet needs and the staleness rule does not: sockets, processes, signals, the handshake's MACs
FLEET_MODULES = {"socket", "multiprocessing", "multiprocessing.connection", "signal", "hmac", "subprocess",
                 f"{PACKAGE}.wire"}


def test_pipeline_rl_is_the_rule_and_its_scheduler_and_the_harness_never_imports_it() -> None:
    """pipeline_rl.py holds no socket, process or handshake code (those live in harness/fleet.py and
    harness/vllm_replica.py), and no module of the harness imports it back: the recipe stands on the harness."""
    imported = set()
    for node in ast.walk(parsed("pipeline_rl.py")):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    assert not imported & FLEET_MODULES, f"pipeline_rl.py imports {sorted(imported & FLEET_MODULES)}"


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
    """The measures above on made-up source: a long function, a long class and a nested function are all seen; a
    scheduler part that reads another's state is named; an import out of its layer is found wherever it is."""
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

    layered = {  # made-up modules: each import below breaks a layer, the lazy and the literal ones too
        "harness.flags": "import os\nfrom harness import cli\nimport grpo\ndef f():\n    import pipeline_rl\n",
        "harness.runtime": "from . import flags\nimport importlib\nm = importlib.import_module('scaling_fit')\n"
                           "from train import main\n",
        "harness.wire": "def g():\n    from tools import bench\n",
        "pipeline_rl": "import tools.experiments\n",
        "tools.bench": "import train, scaling_fit, pipeline_rl\nfrom harness import flags\n",
        "grpo": "from __future__ import annotations\nimport math\nimport torch\nfrom torch import Tensor\n"
                "import numpy as np\ndef f():\n    from dapo import compute_loss\n    __import__('harness.flags')\n",
    }
    found = [problem for module, source in layered.items()
             for rule in (beneath_the_recipe, beneath_the_tools, loss_file_imports)
             for problem in rule(module, ast.parse(source))]
    assert found == ["harness.flags imports pipeline_rl (line 5)",
                     "harness.runtime imports scaling_fit (line 3)", "harness.runtime imports train (line 4)",
                     "harness.wire imports tools.bench (line 2)",
                     "pipeline_rl imports tools.experiments (line 1)",
                     "grpo imports numpy (line 5)", "grpo imports dapo (line 7)", "grpo imports harness (line 8)"], found
    assert ("harness.flags", 1) in imports(ast.parse("from . import flags\n"), "harness.runtime")


if __name__ == "__main__":
    for rule in (beneath_the_recipe, beneath_the_tools, loss_file_imports):
        print(f"{rule.__name__}: " + ("; ".join(layer_problems(rule)) or "nothing out of its layer"))
    for name, row in counts().items():
        kind_def, kind_class = row["longest_def"], row["longest_class"]
        firsts = {f: row["first_line"][f] for (n, f) in MAX_FIRST_LINE if n == name}
        print(f"{name:24} {row['lines']:5} lines  longest def {kind_def[1]} ({kind_def[3]})"
              + (f"  longest class {kind_class[1]} ({kind_class[3]})" if kind_class else "")
              + "".join(f"  def {f}( at line {line}" for f, line in firsts.items()))
    sys.exit(0)
