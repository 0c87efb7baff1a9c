"""The package's structure, pinned: no import circles, no module reads another package's
private (underscore-prefixed) names, and the tools are leaves of the import graph.

Pure logic over the source (``ast``); nothing is imported or run. Issue 26 paid these debts
(the job's owner in ``gradsync/job.py``, the shared region pieces below ``regions`` and
``region_peer``, ...); this test keeps them paid. A private name may be read inside its own
package (the same folder): that is what the underscore says.

The tools (issue 39): ``bench`` measures, ``simulate`` predicts, and ``testbed`` holds what
both stand on (the emulated cluster, the models, ``--json``). Nothing the ranks load imports
any of them; the one way in from the runtime is the ``gradsync`` command's dispatch
(``run/cli.py``), which imports a tool's entry point inside the function that runs that
command. ``bench`` and ``simulate`` import nothing from each other, and ``testbed`` nothing
from either: a piece both need moves down into ``testbed`` rather than across.

The host's shared segment (issue 39, item 2) is a transport: besides the transport itself,
only the set-up that opens it, the World that holds it and the operations that run the shm
algorithm on it may reach it; the front doors ask World.

The floors (issue 39, item 6): the runtime's folders are the design map's layers, and a
module imports from its own floor and those below it, never from one above; the package's top
level holds only the public face and what every floor shares.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gradsync"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _package_of(module: str, modules: dict[str, Path]) -> str:
    """The folder a module lives in, as a dotted name (a package's ``__init__`` is its own)."""
    if modules[module].name == "__init__.py":
        return module
    return module.rpartition(".")[0]


def _resolve(module: str, level: int, target: str | None, modules: dict[str, Path]) -> str:
    if level == 0:
        return target or ""
    base = _package_of(module, modules).split(".")
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    """The module at ``path``, parsed once per pytest process (every test here walks the
    whole package: parsing it anew each time was 8 of the file's 10 s). Nothing changes a
    tree: the tests only read them."""
    return ast.parse(path.read_text(), str(path))


def _walk(modules: dict[str, Path]):
    """Yields (module, imported module, private names read from it) for every import."""
    for module, path in modules.items():
        tree = _tree(path)
        aliases: dict[str, str] = {}  # local name -> module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in modules:
                        yield module, a.name, ()
                        if a.asname:
                            aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(module, node.level, node.module, modules)
                if source not in modules:
                    continue
                private = []
                for a in node.names:
                    sub = f"{source}.{a.name}"
                    if sub in modules:  # a submodule, imported by name
                        yield module, sub, ()
                        aliases[a.asname or a.name] = sub
                    elif a.name.startswith("_") and not a.name.startswith("__"):
                        private.append(a.name)
                yield module, source, tuple(private)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                yield module, aliases[node.value.id], (node.attr,)


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _parents(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_the_package_has_no_import_circle():
    modules = _modules()
    edges: dict[str, set[str]] = {}
    for module, imported, _ in _walk(modules):
        # Importing a submodule runs its parents' __init__ first; a package's face that hands
        # its children's names on is not a circle with them.
        if imported != module and imported not in _parents(module):
            edges.setdefault(module, set()).add(imported)
    assert _circles(edges) == []


def test_no_module_reads_another_packages_private_names():
    modules = _modules()
    reads = sorted({f"{module} reads {imported}.{name}"
                    for module, imported, names in _walk(modules) for name in names
                    if _package_of(module, modules) != _package_of(imported, modules)})
    assert reads == []


TOOLS = ("gradsync.bench", "gradsync.simulate", "gradsync.testbed")
# The gradsync command: `gradsync bench`, `plan`, `probe` and `simulate` run a tool.
COMMAND = "gradsync.run.cli"


def _tool(module: str) -> str | None:
    return next((t for t in TOOLS if module == t or module.startswith(t + ".")), None)


def _imported_at_load(module: str, modules: dict[str, Path]) -> set[str]:
    """The modules that importing ``module`` imports: every import outside a function body."""
    found: set[str] = set()
    pending: list[ast.AST] = [_tree(modules[module])]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue  # runs when called, not when imported
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node.level, node.module, modules)
            found.add(source)
            found.update(f"{source}.{a.name}" for a in node.names)
        pending.extend(ast.iter_child_nodes(node))
    return found


def test_the_runtime_imports_no_tool_but_the_command_that_runs_one():
    modules = _modules()
    at_load = _imported_at_load(COMMAND, modules)
    found = sorted({f"{module} imports {imported}" for module, imported, _ in _walk(modules)
                    if _tool(module) is None and _tool(imported) is not None
                    and not (module == COMMAND and imported not in at_load)})
    assert found == []


def test_the_tools_import_nothing_of_each_other_and_the_testbed_neither():
    # bench and simulate may both use the testbed; neither reaches across, and the testbed
    # reaches up into neither.
    allowed = {("gradsync.bench", "gradsync.testbed"), ("gradsync.simulate", "gradsync.testbed")}
    found = sorted({f"{module} imports {imported}" for module, imported, _ in _walk(_modules())
                    if _tool(module) and _tool(imported) and _tool(module) != _tool(imported)
                    and (_tool(module), _tool(imported)) not in allowed})
    assert found == []


# The runtime's floors, bottom up (docs/internals.md, "Layout"). A module on a floor imports
# from its own floor and those below it; everything not on a floor (the front doors: api,
# torch, ps, data, elastic, compress; the launcher; the tools) stands above them all.
FLOORS = (
    ("what every floor shares", ("gradsync.errors", "gradsync.logs", "gradsync.config",
                                 "gradsync._native")),
    ("the job before it is connected", ("gradsync.cluster",)),
    ("bytes between two ranks", ("gradsync.transport",)),
    ("algorithms over the transport", ("gradsync.collectives",)),
    ("the watchers", ("gradsync.liveness", "gradsync.flight_recorder")),
    ("the connected job", ("gradsync.connect",)),
    ("the operation pipeline", ("gradsync.pipeline",)),
    ("the process's job", ("gradsync.job",)),
)
# Imports that still go up a floor, each with its reason. A debt paid comes off the list (the
# test fails while a listed import no longer exists), so the list only shrinks.
UPWARD = {
    # A one-sided region's asynchronous calls hand out the engine's Handle: the engine sits
    # below the transport in the import graph (issue 39, item 1).
    ("gradsync.transport.region_peer", "gradsync.pipeline.engine"),
}
# The package's top level: the public face, what every floor shares, and the two modules whose
# paths the docs give users (gradsync.flight_recorder.dump, gradsync.timeline.merge).
TOP = {"__init__", "__main__", "api", "job", "config", "errors", "logs", "_native",
       "_torch_hook", "flight_recorder", "timeline"}


def _floor(module: str) -> int | None:
    for index, (_, members) in enumerate(FLOORS):
        if any(module == m or module.startswith(m + ".") for m in members):
            return index
    return None


def test_every_floor_imports_only_its_own_floor_and_those_below():
    modules = _modules()
    missing = [m for _, members in FLOORS for m in members if m not in modules]
    assert missing == []
    up = set()
    for module, imported, _ in _walk(modules):
        here = _floor(module)
        # The package itself ("from .. import x" reads it) is no floor: it runs first anyway.
        if here is None or imported == "gradsync":
            continue
        there = _floor(imported)
        if there is None or there > here:
            up.add((module, imported))
    assert sorted(f"{a} imports {b}" for a, b in up - UPWARD) == []
    assert sorted(UPWARD - up) == []  # paid: take it off UPWARD


def test_the_top_level_holds_only_the_public_face_and_what_the_floors_share():
    assert sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in TOP) == []


# The host's shared segment is a transport (issue 39, item 2): the modules that may reach it,
# by importing its modules or by reading World's handle on it. The front doors ask World
# instead (``shares_host``, ``small_road``, ``shared_above``, ``shared_buffer``,
# ``release_shared``, ``release_shared_with``, ``is_shared``, ``host_traffic``), and
# ``operations`` runs the planner's ``shm`` algorithm through ``host_allreduce``,
# ``host_broadcast`` and ``host_barrier``. A module that stops reaching it comes off the
# list, so the list only shrinks. The segment is ``host_segment`` (``ShmGroup``) and the
# modules it stands on, split from it in session 12: reaching any of them is reaching it.
SEGMENT = {"gradsync.transport.host_segment", "gradsync.transport.segment_layout",
           "gradsync.transport.segment_sync", "gradsync.transport.segment_small",
           "gradsync.transport.segment_shared"}
HANDLE = "shm_group"
REACH_SEGMENT = {
    "gradsync.connect._shm_setup",   # opens it, when every rank of the job is on one host
    "gradsync.connect.world",        # holds it, closes it, answers the front doors' questions
}                                    # and runs the shm algorithm's calls for ``operations``


def _reaches_segment(modules: dict[str, Path]) -> set[str]:
    """The modules that import one of the segment's modules or read ``HANDLE`` (as an
    attribute, or by name through ``getattr``)."""
    found = {module for module, imported, _ in _walk(modules) if imported in SEGMENT}
    for module, path in modules.items():
        for node in ast.walk(_tree(path)):
            if ((isinstance(node, ast.Attribute) and node.attr == HANDLE)
                    or (isinstance(node, ast.Constant) and node.value == HANDLE)):
                found.add(module)
    return found


def test_only_the_transport_and_its_set_up_reach_the_hosts_shared_segment():
    modules = _modules()
    assert sorted(SEGMENT - set(modules)) == []
    outside = {m for m in _reaches_segment(modules) if not m.startswith("gradsync.transport.")}
    assert sorted(outside - REACH_SEGMENT) == []  # a front door reaching it: ask World
    assert sorted(REACH_SEGMENT - outside) == []  # paid: take it off REACH_SEGMENT
