"""The import graph: no cycle among the project's modules (lazy imports inside functions
included), launcher/config/ imports nothing else of the project, and no module changes
the environment when it is imported (the hub's offline switches are set by the entry
points: the launcher, a rank); functions short (FUNCTION_LINES, a few named exceptions), no
file without bound (LINES), and an import inside a function says why (LOCAL_REASONS)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys

from runs import REPO

PACKAGES = ("launcher", "engines")
# A file holds one concept and may be as long as that concept needs; LINES only keeps any
# file from growing without bound (docs/ARCHITECTURE.md, "Rules about concepts").
LINES = 600
# A function reads in one screen: 50 hand-wrapped lines, 60 since ruff format lays out the
# tree (a call that does not fit one line takes a line per argument: the Python files went
# from 39,361 lines to 45,812, +16%).
FUNCTION_LINES = 60
# Functions over FUNCTION_LINES, by name: each one is a single sequence that splitting would
# only scatter (or is another helper's to split); a new long function fails the test, and
# one that gets short must leave this list.
LONG_FUNCTIONS = {
    "engines/zero/engine.py::terms_held",
}

# Imports stand at the module top; one inside a function says why on its line (or the line
# above, a comment alone), `# local: <reason> (<detail>)`, with one of these reasons
# (docs/ARCHITECTURE.md, "Imports stand at the top").
LOCAL_REASONS = {
    "torch": "the launch side imports this module and imports no torch (nor transformers, DeepSpeed)",
    "side": "a call across the sides: launch -> rank or rank -> launch, never at import",
    "cycle": "the two modules would import each other at import time",
    "start-up": "a measured cost (package, seconds) that a path without this call would pay",
    "optional": "an extra that may be absent (transformers, torchao, pyarrow, tensorboard)",
    "order": "something must run first (DS_ACCELERATOR before DeepSpeed, Ctrl-C caught before the imports)",
}
LOCAL = re.compile(r"#.*\blocal: (" + "|".join(map(re.escape, LOCAL_REASONS)) + r") \(.+\)")


def modules() -> dict[str, ast.Module]:
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            out[name] = (path, ast.parse(path.read_text()))
    return out


def import_graph(at_import: bool = False) -> dict[str, set[str]]:
    """module -> the project's modules it imports anywhere in its text (`from pkg import
    sub` counts as importing pkg.sub when that is a module, else pkg). at_import: only
    what importing it runs at once (module level, class bodies; never a function's body),
    each target with the packages above it, whose __init__ runs first."""
    mods = modules()

    def project(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, (path, tree) in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        if at_import:
            tree = ast.Module(
                body=[n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))],
                type_ignores=[],
            )
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                if t.split(".")[0] in PACKAGES and (found := project(t)) and found != name:
                    parts = found.split(".")
                    edges |= (
                        ({".".join(parts[:i]) for i in range(1, len(parts) + 1)} & set(mods)) if at_import else {found}
                    )
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_the_projects_modules():
    graph = import_graph()
    assert len(graph) > 40 and graph["launcher.rank.entry"]  # the walk sees the project
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(
        " / ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in found
    )


def test_the_cycle_check_finds_a_lazy_cycle():
    graph = import_graph()
    graph["launcher.config"] = {"launcher.models.hf"}  # the lazy import config once had (model=hf's shape)
    assert any({"launcher.config", "launcher.models.hf"} <= set(c) for c in cycles(graph))


def test_config_imports_nothing_else_of_the_project():
    inside = lambda name: name == "launcher.config" or name.startswith("launcher.config.")  # noqa: E731
    config = {name: edges for name, edges in import_graph().items() if inside(name)}
    assert len(config) > 5 and all(inside(e) for edges in config.values() for e in edges), config


def third_party_imports() -> list[str]:
    """The other packages' modules the project imports at module level (dotted names)."""
    out = set()
    for _, tree in modules().values():
        for node in tree.body:
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                out.add(node.module)
    return sorted(n for n in out if n.split(".")[0] not in PACKAGES + ("__future__",))


def test_no_module_changes_the_environment_when_imported():
    """Other packages may set variables when imported (DeepSpeed, torch's inductor do):
    they are imported first, so what changes after is the project's own doing."""
    names = sorted(n for n in modules() if not n.endswith("__main__"))
    code = (
        "import contextlib, importlib, json, os, sys\n"
        f"for name in {third_party_imports()!r}:\n"
        "    with contextlib.suppress(ImportError):\n"
        "        importlib.import_module(name)\n"
        "import torch._inductor.config\n"
        "before = dict(os.environ)\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "changed = sorted(k for k in set(os.environ) | set(before) if os.environ.get(k) != before.get(k))\n"
        "print(json.dumps({'changed': changed, 'hub': 'huggingface_hub' in sys.modules}))\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["changed"] == [], result


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def side_crossings(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for every launch-side module that imports a rank-side one at import time
    (directly or through others), and the reverse."""
    out = []
    for mine, theirs in (("launcher.launch", "launcher.rank"), ("launcher.rank", "launcher.launch")):
        for name in sorted(graph):
            if name == mine or name.startswith(mine + "."):
                out += [
                    f"{name} -> {m}" for m in sorted(reach(graph, name)) if m == theirs or m.startswith(theirs + ".")
                ]
    return out


def test_neither_side_imports_the_other_when_imported():
    """The launch side (launcher/launch/) and the rank side (launcher/rank/) meet in the
    shared packages (config, models, parallel, planner, data, the top-level modules) and
    in the frozen config.yaml; a call across is a lazy import, never an import-time one."""
    graph = import_graph(at_import=True)
    assert reach(graph, "launcher.rank.entry") >= {"launcher.rank.loop", "launcher.config"}
    assert side_crossings(graph) == []
    graph["launcher.launch.rundir.prepare"] |= {"launcher.rank.checkpoint"}  # the import rundir once had
    assert "launcher.launch.rundir.prepare -> launcher.rank.checkpoint" in side_crossings(graph)
    assert "launcher.launch.cli -> launcher.rank.checkpoint" in side_crossings(graph)


def test_the_launch_side_imports_no_torch_when_imported():
    """`launcher --help` and composing a config import no torch, CUDA or torch.distributed:
    every launch-side module and the console entry, imported in a fresh interpreter."""
    names = sorted(n for n in modules() if n.startswith("launcher.launch")) + ["launcher.__main__"]
    code = (
        f"import importlib, sys\nfor name in {names!r}:\n    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'deepspeed', 'transformers'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout[:2000]


def test_deciding_a_run_imports_no_torch(tmp_path):
    """`launcher train --dry-run` of every engine outside DeepSpeed (compose, validate, the
    disk check on the real shape, the schedule, the run files, the command) imports no
    torch: the recipes' specs are read without their engines. ZeRO's launch side imports
    DeepSpeed (and so torch) to check its JSON with DeepSpeed's own parser."""
    import engines
    from launcher.launch.compose import recipe_configs

    outside = [name for name, recipe in recipe_configs().items() if not engines.spec(recipe.engine).deepspeed]
    assert len(outside) >= 2
    runs = [
        ["train", f"recipe={r}", "model=gpt_tiny", "train.steps=2", f"hydra.run.dir={tmp_path / r}", "--dry-run"]
        for r in outside
    ]
    code = (
        "import contextlib, io, sys\nfrom launcher.launch.cli import main\n"
        f"for argv in {runs!r}:\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        assert main(argv) == 0, argv\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'deepspeed', 'transformers'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout[:2000]


def test_the_suite_is_split_by_what_it_starts():
    """tests/e2e/ holds the tests that start real multi-process runs (marked slow) and
    `make test-quick` runs tests/unit/ alone: a slow test in unit/ would make the quick
    suite slow, an unmarked one in e2e/ would escape `-m "not slow"`."""
    wrong = []
    for folder, slow in (("unit", False), ("e2e", True)):
        for path in sorted((REPO / "tests" / folder).glob("test_*.py")):
            tree = ast.parse(path.read_text())
            everywhere = any(
                isinstance(n, ast.Assign)
                and "pytestmark" in ast.unparse(n.targets[0])
                and "slow" in ast.unparse(n.value)
                for n in tree.body
            )
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                    marked = everywhere or any("slow" in ast.unparse(d) for d in node.decorator_list)
                    if marked != slow and not (path.name == "test_readme.py" and not marked):
                        wrong.append(f"{folder}/{path.name}::{node.name}")
    assert len(list((REPO / "tests" / "e2e").glob("test_*.py"))) > 10
    assert wrong == [], wrong


def test_no_python_file_grows_without_bound():
    """Files are split by concept, not by size (a folder of peers gets rooms, launch/ has
    checks/, commands/, rundir/, start/, submit/); LINES is the backstop: every Python file
    of the project (the packages, the scripts, the tests) holds at most LINES lines."""
    long = {
        str(path.relative_to(REPO)): n
        for folder in (*PACKAGES, "scripts", "tests")
        for path in sorted((REPO / folder).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > LINES
    }
    assert long == {}, long


def long_functions() -> dict[str, int]:
    """'path::name' -> lines, for every function of the packages over FUNCTION_LINES lines
    (from `def` to its last line, nested functions counted in their parent and alone)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if (n := node.end_lineno - node.lineno + 1) > FUNCTION_LINES:
                        out[f"{path.relative_to(REPO)}::{node.name}"] = n
    return out


def test_functions_are_short():
    """At most FUNCTION_LINES lines a function, but for the named LONG_FUNCTIONS, and the
    named ones still are long (a split one leaves the list, so the list stays true)."""
    found = long_functions()
    assert set(found) - LONG_FUNCTIONS == set(), {k: v for k, v in found.items() if k not in LONG_FUNCTIONS}
    assert LONG_FUNCTIONS - set(found) == set(), "short now, drop from LONG_FUNCTIONS"


def unexplained_local_imports(sources: dict[str, str]) -> list[str]:
    """'path:line: import' for each import inside a function whose line (or the comment
    line above it) gives no `# local: <reason> (<detail>)` with a reason of LOCAL_REASONS."""
    out = set()
    for name, text in sources.items():
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        here, above = lines[node.lineno - 1], lines[node.lineno - 2].strip()
                        if not (LOCAL.search(here) or (above.startswith("#") and LOCAL.search(above))):
                            out.add(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return sorted(out)


def test_an_import_inside_a_function_says_why():
    sources = {
        str(path.relative_to(REPO)): path.read_text() for package in PACKAGES for path in (REPO / package).rglob("*.py")
    }
    assert len(sources) > 100 and sum(bool(LOCAL.search(t)) for t in sources.values()) > 20  # the walk sees them
    assert unexplained_local_imports(sources) == []


def test_the_reason_check_finds_a_bare_local_import():
    sources = {
        "bare.py": "import os\n\n\ndef f():\n    import json\n\n    return json\n",
        "said.py": "def g():\n    import torch  # local: torch (launch side)\n\n    # local: optional (transformers)\n"
        "    from transformers import AutoConfig\n",
        "unknown.py": "def h():\n    import json  # local: because (it was here)\n",
        "top.py": "import json\n",
    }
    assert unexplained_local_imports(sources) == ["bare.py:5: import json", "unknown.py:2: import json"]
