"""The docs against the code: docs/recipe.md's table of ScaleRL's components names functions that exist where it says,
and no page shows a path from the machine the docs were written on. Fast: the Python files are parsed, never
imported."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "docs" / "recipe.md"
TABLE_HEADING = "## ScaleRL's components, and where each lives"


def component_table(text: str) -> list[tuple[str, str, list[str], str]]:
    """The rows of the components table as (component, flag, functions, file); a row with an empty component cell
    continues the one above and gets its name."""
    lines = text[text.index(TABLE_HEADING):].splitlines()[1:]
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows, component = [], ""
    for line in lines[start + 2:]:  # past the header and the |---| line
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 4, f"docs/recipe.md: a components row needs 4 cells: {line}"
        component = cells[0] or component
        functions = re.findall(r"`([A-Za-z_]\w*)`", cells[2])
        files = re.findall(r"`([\w/]+\.py)`", cells[3])
        assert functions and len(files) == 1, f"docs/recipe.md: a row names functions and one file: {line}"
        rows.append((component, cells[1], functions, files[0]))
    return rows


def top_level_names(path: Path) -> set[str]:
    """Functions and classes defined at the top level of a Python file, read with ast."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return {node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


TABLE = component_table(RECIPE.read_text())
NAMED = sorted({(file, function) for _, _, functions, file in TABLE for function in functions})


def test_the_components_table_covers_scalerls_recipe():
    components = " ".join(row[0] for row in TABLE).lower()
    for part in ("pipelinerl", "cispo", "aggregation", "advantage normalisation", "zero-variance",
                 "no-positive-resampling", "interruption", "fp32 lm head", "sigmoid fit"):
        assert part in components, f"docs/recipe.md's components table has no row for {part}"


@pytest.mark.parametrize("file,function", NAMED, ids=[f"{f}::{fn}" for f, fn in NAMED])
def test_every_function_in_the_components_table_is_defined_in_its_file(file, function):
    path = ROOT / file
    assert path.is_file(), f"docs/recipe.md names {file}, which does not exist"
    assert function in top_level_names(path), f"docs/recipe.md names {function} in {file}, which defines no such " \
                                              "top-level function or class"


PAGES = sorted(ROOT.glob("docs/*.md")) + [ROOT / "README.md"]
# An absolute path, not part of a URL or of a longer relative path: its leading / follows no word character, dot,
# tilde, colon, slash or placeholder bracket.
ABSOLUTE_PATH = re.compile(r"(?<![\w.~:/<>$-])(/[\w.-]+)+/?")
CACHE_IN_A_TREE = re.compile(r"(?<![\w.~:/<>$-])/[\w.-]+/[\w.-]+/\.cache/")  # /work/main/.cache/, /tmp/x/.cache/


def machine_paths(text: str, root: Path) -> list[str]:
    """Paths in a page that belong to one checkout: the checkout's own absolute path, a `.cache/` two directories
    below the file system's root, or an absolute path through a directory named like the checkout."""
    found = [str(root)] if str(root) in text else []
    found += [m.group(0) for m in CACHE_IN_A_TREE.finditer(text)]
    for m in ABSOLUTE_PATH.finditer(text):
        parts = m.group(0).strip("/").split("/")
        if len(parts) >= 2 and root.name in parts:
            found.append(m.group(0))
    return found


def test_the_path_check_finds_checkout_paths_and_passes_ordinary_ones():
    root = Path("/work/main")
    assert machine_paths('{"model_dir": "/work/main/.cache/tiny-arith-2272d145"}', root)
    assert machine_paths("tar czf x.tgz -C /srv/main .cache/tiny-arith", root)
    assert machine_paths("/tmp/ws-checkout/.cache/tiny-arith-2272d145", root)
    ordinary = ("/dev/shm", "/proc/version", "runs/x/.cache/y", "<checkout>/.cache/tiny-arith-<hash>",
                "https://github.com/a/main", "$HOME/.cache/huggingface", "~/.cache/x", "git checkout main")
    for text in ordinary:
        assert not machine_paths(text, root), text


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_no_page_shows_a_path_of_the_checkout(page):
    assert not machine_paths(page.read_text(), ROOT), f"{page.relative_to(ROOT)} shows a checkout's own path"


def test_the_readme_file_map_names_every_python_file():
    """README.md's file map names each of the root's Python files (the card's nine), each module of the package
    harness/ beneath them and each of the tools above (tools/), so a file moved or added shows in the map."""
    section = (ROOT / "README.md").read_text().split("## Where each part lives")[1].split("```")[1]
    named = set(re.findall(r"\w+\.py", section))
    root = {p.name for p in ROOT.glob("*.py")}
    packages = {p.name for package in ("harness", "tools") for p in (ROOT / package).glob("*.py")
                if p.name != "__init__.py"}
    assert "\nharness/" in section and "\ntools/" in section, "README.md's file map has no harness/ or tools/ entry"
    assert not (root | packages) - named, f"README.md's file map misses {sorted((root | packages) - named)}"


README_MAX_LINES = 100  # a front page that fits a screen; measured results and long explanations live in docs/
README_MAX_WIDTH = 120


def front_page_problems(text: str) -> list[str]:
    """What keeps a front page from fitting a screen: more than README_MAX_LINES lines, or a line wider than
    README_MAX_WIDTH characters (each named by its number)."""
    lines = text.splitlines()
    problems = [f"{len(lines)} lines (at most {README_MAX_LINES})"] if len(lines) > README_MAX_LINES else []
    return problems + [f"line {n}: {len(line)} characters (at most {README_MAX_WIDTH})"
                       for n, line in enumerate(lines, start=1) if len(line) > README_MAX_WIDTH]


def test_the_readme_fits_a_screen():
    assert front_page_problems("a\n" * README_MAX_LINES + "b" * README_MAX_WIDTH) == [
        f"{README_MAX_LINES + 1} lines (at most {README_MAX_LINES})"]
    assert front_page_problems("a\n" + "b" * (README_MAX_WIDTH + 1)) == [
        f"line 2: {README_MAX_WIDTH + 1} characters (at most {README_MAX_WIDTH})"]
    problems = front_page_problems((ROOT / "README.md").read_text())
    assert not problems, "README.md: " + "; ".join(problems)


def test_the_readme_is_a_front_page():
    """What the front page holds: the two commands and what make run prints, the file map, the algorithms table
    (one row per algorithm file) and links to the docs pages, each of which exists."""
    text = (ROOT / "README.md").read_text()
    assert "make run " in text and "make test " in text and "step 0: val pass rate" in text
    table = [line for line in text.split("## The algorithms")[1].splitlines() if line.startswith("| `")]
    assert [re.match(r"\| `(\w+)\.py`", row).group(1) for row in table] == ["grpo", "dapo", "drgrpo", "gspo",
                                                                           "cispo", "tis"]
    links = re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[\w-]+)?\)", text)
    assert links and [link for link in links if not (ROOT / link).is_file()] == []
