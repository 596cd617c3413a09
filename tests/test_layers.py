"""House order (DESIGN §1): every module of `metrale` imports only from its own layer or
the layers below it, no two modules import each other (directly or round a circle), and no
module is over 400 lines.

Imports are read with `ast`, function-level (lazy) and `if TYPE_CHECKING:` imports
included: a lazy import is still a dependency, only a later one, and a type-only one still
says which module knows about which.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "metrale"
MAX_LINES = 400

# The layer of each module, by the longest matching dotted prefix. DESIGN §1 numbers the
# packages 1..7; the modules it does not name sit where their imports say they belong:
#   errors            — imported by everything, imports nothing: below the device.
#   kernels           — the .cu sources (data, no Python). gpu_runtime.kernel_source finds
#                       them for the backends that compile them (DESIGN §1: CudaBackend
#                       builds RawModules from kernels/*.cu), so they sit at the device's
#                       layer; the ops launchers above only name them.
#   ops               — "1½": launchers and numpy twins over the backend.
#   audio             — wav reading and log-mel features over numpy: an input format.
#   vision.preprocess, vision.text_source — image preprocessing and the llava text-model
#                       view of a checkpoint: formats work.
#   vision.clip/mixin/llava, whisper.passes/weights — the pointer-API models beside
#                       model_engine (layer 4).
#   whisper.model, whisper (package), vision.generative, vision (package, whose lazy
#                       attributes reach `vision.generative`) — tensor-contract models
#                       (layer 5).
#   api               — `metrale.load` / `load_generative`: dispatch over every model
#                       (above layer 5, below the engine that users call).
#   metrale (the package __init__) — the public names; it reaches `api` lazily.
#   cli, bench        — what users run from a shell: the top.
LAYERS = {
    "metrale.errors": 0,
    "metrale.progress": 0,   # lines on stderr about long work; imports nothing of metrale
    "metrale.gpu_runtime": 1,
    "metrale.kernels": 1,
    "metrale.ops": 1.5,
    "metrale.formats": 2,
    "metrale.audio": 2,
    "metrale.vision.preprocess": 2,
    "metrale.vision.text_source": 2,
    "metrale.kv": 3,
    "metrale.model_engine": 4,
    "metrale.vision.clip": 4,
    "metrale.vision.mixin": 4,
    "metrale.vision.llava": 4,
    "metrale.whisper.passes": 4,
    "metrale.whisper.weights": 4,
    "metrale.generative": 5,
    "metrale.whisper": 5,
    "metrale.vision": 5,
    "metrale.api": 5.5,
    "metrale.engine": 6,
    "metrale": 6.5,
    "metrale.bench": 7,
    "metrale.cli": 7,
    "metrale.__main__": 7,   # `python -m metrale`: the command line
}

# Known edges against the house order (upward, or one half of an import circle) that others
# are removing; each names the work that removes it. They are skipped by both checks; an
# entry that no longer occurs fails the test, so the list only shrinks.
ALLOWED_EDGES: set[tuple[str, str]] = set()  # none left; a new one needs a comment and a remover


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}
# Packages with no Python in metrale/: `metrale.kernels` is the top-level kernels/ directory
# of .cu sources, shipped in the wheel under that name (pyproject.toml).
DATA_PACKAGES = {"metrale.kernels"}


def layer_of(module: str) -> float:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYERS:
            return LAYERS[prefix]
    raise AssertionError(f"{module}: no layer in LAYERS; add it with a reason")


def imports_of(module: str) -> set[str]:
    """The `metrale` modules that `module` imports anywhere in its body."""
    path = MODULES[module]
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            # `from pkg import sub` imports the submodule when there is one.
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in MODULES else stem
                       for a in node.names]
        else:
            continue
        for t in targets:
            # the nearest metrale module named; other packages' names strip to nothing
            while t and t not in MODULES and t not in DATA_PACKAGES:
                t = t.rpartition(".")[0]
            if t and t != module:
                found.add(t)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_module_has_a_layer():
    for m in MODULES:
        layer_of(m)


def test_imports_only_go_down():
    upward = sorted((m, t) for m, ts in GRAPH.items() for t in ts
                    if layer_of(t) > layer_of(m) and (m, t) not in ALLOWED_EDGES)
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(
        f"  {m} (layer {layer_of(m)}) -> {t} (layer {layer_of(t)})" for m, t in upward)


def test_allowlist_is_still_needed():
    stale = sorted(e for e in ALLOWED_EDGES if e[1] not in GRAPH.get(e[0], ()))
    assert not stale, f"remove these from ALLOWED_EDGES, they no longer occur: {stale}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    graph = {m: {t for t in ts if (m, t) not in ALLOWED_EDGES} for m, ts in GRAPH.items()}
    cycles = _cycles(graph)
    assert not cycles, "modules that import each other:\n" + "\n".join(
        "  " + " <-> ".join(c) for c in cycles)


def test_no_module_over_400_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_import_reader_sees_lazy_and_package_imports():
    # The checker itself: function-level imports count (api imports every model lazily),
    # `from . import sub` names the submodule, a data package is a node of its own.
    assert {"metrale.model_engine", "metrale.whisper", "metrale.vision.llava",
            "metrale.vision.generative"} <= GRAPH["metrale.api"]
    assert "metrale.cli.bench" in GRAPH["metrale.cli"]
    assert "metrale.kernels" in GRAPH["metrale.gpu_runtime.kernel_source"]


def test_cycle_finder_finds_a_circle():
    # The checker itself: a three-module circle is found, a chain is not.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
