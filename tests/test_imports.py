"""The import graph of jaxkv/ has no cycles: the arrows run one way (docs/structure.md).

The graph is read from the source, not from a running interpreter, so it also sees the imports
inside functions (the lazy ones, which a cycle likes to hide behind). Every ``import a.b`` and
``from a import b`` statement anywhere in a module, relative ones resolved, gives an edge to the
jaxkv module it names: ``from P import n`` points at the submodule ``P.n`` when there is one,
else at ``P``. Importing a submodule runs its package's ``__init__`` too, but that is not an
edge (every submodule would otherwise depend on its own package).
"""

import ast
from pathlib import Path

import pytest

import jaxkv

ROOT = Path(jaxkv.__file__).resolve().parent


def module_names() -> dict[str, Path]:
    """Dotted name -> file of every module and package under jaxkv/."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The jaxkv modules that module ``name`` (at ``path``) imports, at any nesting level."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    """Module -> the jaxkv modules it imports."""
    modules = module_names()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_scan_sees_function_level_and_relative_imports(tmp_path):
    modules = {"jaxkv.a": tmp_path / "a.py", "jaxkv.b": tmp_path / "b.py",
               "jaxkv.p": tmp_path / "p" / "__init__.py", "jaxkv.p.c": tmp_path / "p" / "c.py"}
    modules["jaxkv.a"].write_text("def f():\n    from jaxkv.b import g\n    import jaxkv.p.c\n")
    modules["jaxkv.p"].parent.mkdir()
    modules["jaxkv.p.c"].write_text("from .. import a\nfrom . import c\nfrom ..b import x\n")
    assert imports_of("jaxkv.a", modules["jaxkv.a"], modules) == {"jaxkv.b", "jaxkv.p.c"}
    assert imports_of("jaxkv.p.c", modules["jaxkv.p.c"], modules) == {"jaxkv.a", "jaxkv.b"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_scan_sees_the_known_edges():
    graph = import_graph()
    assert "jaxkv.attention.reference" in graph["jaxkv.attention.pallas.decode"]
    assert {"jaxkv.attention.reference",   # the pallas import is a lazy one
            "jaxkv.attention.pallas"} <= graph["jaxkv.attention.dispatch"]


def test_jaxkv_has_no_import_cycles():
    found = cycles(import_graph())
    assert found == [], "import cycles (each a strongly connected set of modules): " + "; ".join(
        " <-> ".join(c) for c in found)


def external_imports(path: Path) -> set[str]:
    """The top-level names of the packages a module imports (``jax`` for ``jax.numpy``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.partition(".")[0])
    return found


def test_the_block_owners_are_host_only():
    """jaxkv/blocks/ (block manager, prefix cache, host tier) imports, of jaxkv, only itself and
    the config: the scheduler copies and checks it as plain values."""
    graph, modules = import_graph(), module_names()
    for name in (m for m in modules if m.startswith("jaxkv.blocks")):
        assert all(m.startswith(("jaxkv.blocks", "jaxkv.config")) for m in graph[name]), (
            name, graph[name])


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules ``start`` imports, directly or through others (itself excluded)."""
    seen, todo = set(), [start]
    while todo:
        for m in graph[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    return seen


def test_the_host_side_imports_no_jax():
    """The scheduler, the block owners and the speculators' host side (and everything they
    import) never import jax: they plan on plain values, on any machine, at Python speed."""
    graph, modules = import_graph(), module_names()
    host = [m for m in modules if m.startswith(("jaxkv.sched", "jaxkv.blocks"))] + [
        "jaxkv.config", "jaxkv.spec_decode.ngram", "jaxkv.spec_decode.suffix",
        "jaxkv.spec_decode.draft_lengths"]
    for name in host:
        for m in {name} | reachable(graph, name):
            assert not external_imports(modules[m]) & {"jax", "jaxlib", "flax"}, (name, m)


def room(module: str) -> str:
    """A module's room: its folder under jaxkv/ (``jaxkv.sched``), or itself at the top."""
    return ".".join(module.split(".")[:2])


def test_the_rooms_import_each_other_one_way():
    """Folded to rooms (jaxkv/<folder>), the import graph has no cycle: every arrow between
    two rooms runs one way, the order docs/structure.md draws."""
    rooms: dict[str, set[str]] = {}
    for a, targets in import_graph().items():
        rooms.setdefault(room(a), set()).update(room(b) for b in targets if room(b) != room(a))
    found = cycles(rooms)
    assert found == [], "rooms that import each other: " + "; ".join(" <-> ".join(c)
                                                                      for c in found)


@pytest.mark.parametrize("lower,upper", [
    ("jaxkv.runner", ("jaxkv.engine", "jaxkv.spec_decode", "jaxkv.entrypoints", "jaxkv.server")),
    ("jaxkv.sched", ("jaxkv.engine", "jaxkv.runner", "jaxkv.spec_decode", "jaxkv.model")),
    ("jaxkv.attention", ("jaxkv.engine", "jaxkv.sched", "jaxkv.runner", "jaxkv.model",
                         "jaxkv.config", "jaxkv.retention", "jaxkv.spec_decode")),
    ("jaxkv.kvcache", ("jaxkv.engine", "jaxkv.sched", "jaxkv.runner", "jaxkv.model",
                       "jaxkv.attention", "jaxkv.spec_decode")),
    ("jaxkv.model", ("jaxkv.engine", "jaxkv.sched", "jaxkv.runner", "jaxkv.retention",
                     "jaxkv.spec_decode")),
    ("jaxkv.sample", ("jaxkv.engine", "jaxkv.sched", "jaxkv.runner", "jaxkv.model")),
])
def test_a_lower_stage_never_imports_a_higher_one(lower, upper):
    """The runner knows nothing of requests or the engine; kernels, the cache and the model
    know nothing of the scheduler, the runner or the engine."""
    graph = import_graph()
    wrong = {(a, b) for a, targets in graph.items() if room(a) == lower
             for b in targets if room(b) in upper}
    assert not wrong, sorted(wrong)
