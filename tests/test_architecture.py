"""The package's import graph: no cycles, layers import only downwards, every module imports alone.

Read with the standard library's ``ast`` (imports inside functions count
too: a cycle hidden in a function still couples two modules).
"""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

# The library alone: no exercise runs here (tests/conftest.py checks it), so the student edition leaves it out.
pytestmark = pytest.mark.library

PACKAGE = Path(__file__).resolve().parents[1] / "toyllm"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """toyllm modules imported anywhere in the file (relative imports resolved)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("toyllm")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("toyllm"):
                continue
            for alias in node.names:            # `from . import grading` imports the module toyllm.grading
                sub = f"{target}.{alias.name}"
                found.add(sub if _exists(sub) else target)
    return {_owner(m) for m in found} - {name}


def _exists(module: str) -> bool:
    rel = Path(*module.split("."))
    return (PACKAGE.parent / rel).with_suffix(".py").is_file() or (PACKAGE.parent / rel / "__init__.py").is_file()


def _owner(module: str) -> str:
    """The closest existing module (``toyllm.parallel.steps.tsp_layer`` -> ``toyllm.parallel.steps``)."""
    while module and not _exists(module):
        module = module.rpartition(".")[0]
    return module


def _graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    graph = {_module_name(f): _imports(f) for f in files}
    # a package's __init__ re-exporting its submodules is not a cycle with them
    for name in graph:
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    return graph


def _find_cycle(graph):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_import_graph_has_no_cycle():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


# Lower layers never import higher ones (docs/architecture.md draws the same picture).
LAYERS = [
    {"toyllm.utils", "toyllm.timeline", "toyllm.gguf_file", "toyllm.supervise", "toyllm.checks", "toyllm.compile_cache",
     # the course: which implementation of the exercises runs, and the sandbox that runs a submission
     "toyllm.answers", "toyllm.course", "toyllm.stubs",
     "toyllm.grading.settings",
     "toyllm.grading.sandbox.process", "toyllm.grading.sandbox.local", "toyllm.grading.sandbox.guard",
     "toyllm.grading.sandbox.wire", "toyllm.grading.sandbox.launcher",
     "toyllm.grading.sandbox.submission", "toyllm.grading.sandbox.counted"},
    {"toyllm.attention", "toyllm.quant"},
    {"toyllm.model"},
    {"toyllm.cache", "toyllm.paged", "toyllm.tokenizer", "toyllm.analysis", "toyllm.cost_fit", "toyllm.compiled"},
    {"toyllm.weights", "toyllm.generation", "toyllm.serving", "toyllm.launch", "toyllm.partition"},
    {"toyllm.parallel", "toyllm.simulate", "toyllm.simulate_ring", "toyllm.partition_table"},
]


def _layer_of(module: str):
    for i, layer in enumerate(LAYERS):
        if any(module == m or module.startswith(m + ".") for m in layer):
            return i
    return None


def test_layers_import_only_downwards():
    wrong = []
    for module, deps in _graph().items():
        mine = _layer_of(module)
        if mine is None:
            continue
        for dep in deps:
            theirs = _layer_of(dep)
            if theirs is None or theirs > mine:
                wrong.append(f"{module} (layer {mine}) imports {dep} (layer {theirs})")
    assert not wrong, "\n".join(wrong)


MODULES = sorted(_module_name(f) for f in PACKAGE.rglob("*.py") if f.name != "__main__.py")

# One interpreter for all modules (starting one per module would import torch ~30 times): before each
# import every toyllm module is dropped from sys.modules, so each one is imported first, on its own. First of
# all, the module an engine worker imports to run a graded step: whether it brought pytest along.
WORKER_MODULE = "toyllm.grading.sandbox.harness"
_IMPORT_EACH = """
import importlib, json, sys, traceback
importlib.import_module(sys.argv[1])
worker_imports_pytest = "pytest" in sys.modules
failures = {}
for name in sys.argv[2:]:
    for loaded in [m for m in sys.modules if m == "toyllm" or m.startswith("toyllm.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except BaseException:
        failures[name] = traceback.format_exc()[-2000:]
print(json.dumps({"failures": failures, "worker_imports_pytest": worker_imports_pytest}))
"""


@pytest.fixture(scope="module")
def imported():
    out = subprocess.run([sys.executable, "-c", _IMPORT_EACH, WORKER_MODULE, *MODULES], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def import_failures(imported):
    return imported["failures"]


def test_an_engine_worker_running_a_graded_step_does_not_import_pytest(imported):
    """Each of the hundreds of engine workers a grading starts imports the harness; pytest would add 0.13 s to each
    (``toyllm.grading`` imports the grader, which must not import its pytest plugin)."""
    assert imported["worker_imports_pytest"] is False


@pytest.mark.parametrize("module", MODULES)
def test_every_module_imports_on_its_own(module, import_failures):
    assert module not in import_failures, import_failures.get(module)
