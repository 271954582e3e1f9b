"""The codebase's own bars, checked on every CI run from the source alone."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "sglang_ddtree"
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 60


def _modules() -> list[tuple[str, ast.Module]]:
    return [
        (str(p.relative_to(PACKAGE)), ast.parse(p.read_text()))
        for p in sorted(PACKAGE.rglob("*.py"))
    ]


def _imports(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


# The rooms that adapt SGLang's objects to DDTree's; tree/, gdn/, reference/ and the rest are
# plain torch (and Triton) and import none of SGLang.
SGLANG_ROOMS = ("adapter/", "front_door/", "plugin/", "round/", "state/")


def test_only_the_serving_rooms_import_sglang():
    offenders = [
        (name, sorted(m for m in _imports(tree) if m == "sglang" or m.startswith("sglang.")))
        for name, tree in _modules()
        if not name.startswith(SGLANG_ROOMS)
    ]
    assert [o for o in offenders if o[1]] == []


def test_the_package_reads_the_environment_only_in_config():
    readers = []
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                readers.append((name, node.lineno))
    assert {name for name, _ in readers} <= {"config.py"}, readers


# Module state that a `global` statement rebinds, with why it is not on an object: none. The
# options are parsed once per process and handed to who reads them (round/runtime.py).
REBOUND_GLOBALS: dict[tuple[str, str], str] = {}


def test_no_module_rebinds_a_global():
    """No module keeps state it rebinds through `global`: a process's state lives on the objects
    the worker factory makes (runtime.Runtime) and hands to the worker and the hooks."""
    rebound = set()
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                rebound |= {(name, g) for g in node.names}
    assert rebound == set(REBOUND_GLOBALS), rebound


MUTATORS = {
    "append",
    "add",
    "update",
    "extend",
    "insert",
    "pop",
    "popitem",
    "clear",
    "remove",
    "discard",
    "setdefault",
    "__setitem__",
    "__delitem__",
    "sort",
    "reverse",
}
MUTABLE_CALLS = {"list", "dict", "set", "defaultdict", "deque", "OrderedDict", "Counter"}


def _module_holders(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level to a mutable container (a list, dict or set
    display or comprehension, or a call of list(), dict(), set(), ...), one-element ones too."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            value = node.value
            displays = ast.List | ast.Dict | ast.Set | ast.ListComp | ast.DictComp | ast.SetComp
            mutable = isinstance(value, displays) or (
                isinstance(value, ast.Call)
                and getattr(value.func, "id", getattr(value.func, "attr", None)) in MUTABLE_CALLS
            )
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if mutable:
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _holder(node: ast.expr) -> str | None:
    """The name a mutation reaches: `x` of x[...], x.append(...), mod.x[...], mod.x.add(...)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _scope(body: list[ast.stmt]) -> list[ast.AST]:
    """The nodes of one scope: nested functions are scopes of their own."""
    nodes, stack = [], [n for n in body if not isinstance(n, FUNCTIONS)]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack += [c for c in ast.iter_child_nodes(node) if not isinstance(c, FUNCTIONS)]
    return nodes


def _bound_here(func: ast.AST, nodes: list[ast.AST]) -> set[str]:
    """The names a function binds itself (its parameters and assignment targets)."""
    args = func.args
    names = {
        a.arg
        for a in [
            *args.posonlyargs,
            *args.args,
            *args.kwonlyargs,
            *filter(None, (args.vararg, args.kwarg)),
        ]
    }
    for n in nodes:
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
    return names


def _changed_in(nodes: list[ast.AST]) -> set[str]:
    """Names whose container these nodes change in place: item or slice assignment or deletion,
    augmented assignment, or a mutating method."""
    found = set()
    for n in nodes:
        if isinstance(n, ast.Assign | ast.Delete):
            found |= {_holder(t.value) for t in n.targets if isinstance(t, ast.Subscript)}
        elif isinstance(n, ast.AugAssign):
            target = n.target.value if isinstance(n.target, ast.Subscript) else n.target
            found.add(_holder(target))
        elif (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr in MUTATORS
        ):
            found.add(_holder(n.func.value))
    return found - {None}


def _mutated(tree: ast.Module) -> set[str]:
    """Names whose container a module changes in place, at its top level or in a function that
    does not bind the name itself."""
    found = _changed_in(_scope(tree.body))
    for func in ast.walk(tree):
        if isinstance(func, FUNCTIONS[:2]):
            nodes = _scope(func.body)
            found |= _changed_in(nodes) - _bound_here(func, nodes)
    return found


def module_level_mutable_holders(sources: dict[str, str]) -> list[tuple[str, str]]:
    """(module, name) of every top-level mutable container that any of `sources` (module name:
    source text) changes in place."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    changed = set().union(*(_mutated(tree) for tree in trees.values()))
    return sorted(
        (name, held)
        for name, tree in trees.items()
        for held in _module_holders(tree)
        if held in changed
    )


def test_no_module_keeps_mutable_state():
    """No module-level list, dict or set (a one-element holder included) is changed after import:
    what a process learns at run time lives on an object made once and passed explicitly."""
    sources = {name: (PACKAGE / name).read_text() for name, _ in _modules()}
    assert module_level_mutable_holders(sources) == []


def test_the_mutable_state_check_sees_the_holders_it_names():
    """The check above on the shapes that used to hide state: a one-element list written by
    index, a list rebuilt by slice, a set filled by a method, a dict changed from another
    module; constant tables and a function's own containers pass."""
    held = module_level_mutable_holders(
        {
            "a.py": "_table: list = [None]\ndef activate(t):\n    _table[0] = t\n",
            "b.py": "_memo = [None, None]\ndef f(o):\n    _memo[:] = [o, 1]\n",
            "c.py": "_used: set[str] = set()\ndef use(w):\n    _used.add(w)\n",
            "d.py": "CACHE = {}\n",
            "e.py": "import d\ndef put(k):\n    d.CACHE[k] = 1\n",
            "f.py": "HOOKS = {'x': 1}\nNAMES = ('a',)\ndef g():\n    HOOKS = {}\n    HOOKS['y'] = 2\n",
        }
    )
    assert held == [("a.py", "_table"), ("b.py", "_memo"), ("c.py", "_used"), ("d.py", "CACHE")]


def _import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports, at its top level or inside a function."""
    names = {}
    for name, tree in _modules():
        dotted = "sglang_ddtree." + name[: -len(".py")].replace("/", ".")
        names[dotted.removesuffix(".__init__")] = tree
    graph = {}
    for name, tree in names.items():
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # `from package import module` imports that module (and runs the package's
                # __init__, which is not an edge of the module's own)
                subs = {f"{node.module}.{alias.name}" for alias in node.names} & set(names)
                out |= subs or {node.module}
        graph[name] = (out & set(names)) - {name}
    return graph


def test_no_two_modules_import_each_other():
    """The package's imports, deferred ones included, form no cycle (accept_path asked hooks
    whether a batch is DDTREE's while hooks imported accept_path: spec.is_ddtree now)."""
    graph = _import_graph()
    cycles = []
    for start in graph:  # a path back to `start` through its imports
        stack, seen = [(start, (start,))], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(path)
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, (*path, nxt)))
    assert cycles == []


def test_no_product_code_imports_test_code():
    offenders = [
        (name, m)
        for name, tree in _modules()
        for m in _imports(tree)
        if m == "tests" or m.startswith("tests.")
    ]
    assert offenders == []
    assert not (PACKAGE / "testing").exists()  # test helpers live in tests/


def _own_private_names() -> set[str]:
    """Private names the package defines itself: functions, classes, module globals, and
    attributes it assigns (self._x = ...)."""
    names = set()
    for _, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for sub in ast.walk(t):
                        if isinstance(sub, ast.Attribute):
                            names.add(sub.attr)
                        elif isinstance(sub, ast.Name):
                            names.add(sub.id)
    return {n for n in names if n.startswith("_")}


def test_sglang_private_names_are_used_only_in_compat():
    """An SGLang upgrade that renames a private attribute or function changes compat.py alone:
    nowhere else does the package touch a `_name` that the package does not define."""
    own = _own_private_names() | {"_asdict", "_fields", "_replace", "_make"}  # namedtuple API
    found = []
    for name, tree in _modules():
        if name == "adapter/compat.py":
            continue
        for node in ast.walk(tree):
            used = []
            if isinstance(node, ast.Attribute):
                used = [node.attr]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang"):
                used = [alias.name for alias in node.names]
            found += [
                (name, node.lineno, u)
                for u in used
                if u.startswith("_") and not u.startswith("__") and u not in own
            ]
    assert found == []


def _sglang_source(module: str) -> ast.Module | None:
    """An SGLang module's syntax tree, read from the installed package without importing it
    (None: SGLang or the module is not installed)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(spec.submodule_search_locations[0]).joinpath(*module.split(".")[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return ast.parse(path.read_text())
    return None


def _imported_names(tree: ast.Module) -> dict[str, str]:
    """name -> the sglang module it is imported from (`from sglang.x import Name`)."""
    return {
        alias.asname or alias.name: node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang")
        for alias in node.names
    }


def _self_private_assignments(cls: ast.ClassDef) -> set[str]:
    """The `_names` a class's methods assign on self (self._x = ..., self._x += ...)."""
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if (
                        isinstance(sub, ast.Attribute)
                        and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self"
                        and sub.attr.startswith("_")
                        and not sub.attr.startswith("__")
                    ):
                        names.add(sub.attr)
    return names


def _sglang_private_attributes(module: str, name: str, seen: set | None = None) -> set[str]:
    """The private attributes SGLang's class `module.name` and its SGLang bases assign on self."""
    seen = set() if seen is None else seen
    tree = _sglang_source(module)
    if tree is None or (module, name) in seen:
        return set()
    seen.add((module, name))
    imported = _imported_names(tree)
    found = set()
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name):
        found |= _self_private_assignments(cls)
        for base in cls.bases:
            base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
            where = imported.get(base_name, module if base_name else None)
            if where is not None:
                found |= _sglang_private_attributes(where, base_name, seen)
    return found


def test_no_class_assigns_sglangs_inherited_private_attributes_outside_compat():
    """A subclass of an SGLang class (the worker, the verify input, the spec) sets none of the
    private attributes its SGLang bases assign: compat.py does it (set_draft_block), so that an
    SGLang upgrade that renames one changes compat.py alone."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("needs SGLang's source installed")
    found, checked = [], 0
    for name, tree in _modules():
        if name == "adapter/compat.py":
            continue
        imported = _imported_names(tree)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            inherited = set()
            for base in cls.bases:
                if isinstance(base, ast.Name) and base.id in imported:
                    inherited |= _sglang_private_attributes(imported[base.id], base.id)
                    checked += 1
            found += [
                (name, cls.name, attr)
                for attr in sorted(_self_private_assignments(cls) & inherited)
            ]
    assert checked >= 3  # DDTreeWorker, DDTreeVerifyInput, DDTreeSpec
    assert found == []


def test_the_inherited_private_attributes_check_reads_sglangs_classes():
    """The check above reads DFlashWorkerV2's own private attributes through its source: among
    them the draft-block constants DDTREE rebuilds (through compat.set_draft_block)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("needs SGLang's source installed")
    names = _sglang_private_attributes("sglang.srt.speculative.dflash_worker_v2", "DFlashWorkerV2")
    assert {"_block_pos_offsets", "_draft_block_spec_info"} <= names


def test_files_and_functions_stay_short():
    long_files, long_functions = [], []
    for name, tree in _modules():
        lines = (PACKAGE / name).read_text().count("\n")
        if lines > MAX_FILE_LINES:
            long_files.append((name, lines))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append((name, node.name, length))
    assert long_files == [] and long_functions == []


def test_scripts_and_tests_name_no_workplace_transfer_tooling():
    """They work on any GPU host: no path into a workplace's shared tooling, its bundle folder or
    its per-call transfer limits."""
    patterns = re.compile(
        "|".join([r"\.\./" + "shared", r"\." + "gpu/", "MiB " + "per call", r"\b(16|64) " + "MiB"])
    )
    found = []
    for folder in ("scripts", "tests"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".sh", ".md", ".txt"):
                for i, line in enumerate(path.read_text().splitlines(), 1):
                    if patterns.search(line):
                        found.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert found == []


def test_scripts_share_one_harness_and_import_no_tests():
    """The user-runnable scripts import the package, the standard library and each other (their
    shared harness is scripts/harness.py), never tests/, and do not edit sys.path: `python
    scripts/NAME.py` works from any checkout with the package installed."""
    found = []
    for path in sorted((REPO / "scripts").glob("*.py")):
        tree = ast.parse(path.read_text())
        name = path.relative_to(REPO)
        found += [f"{name} imports {m}" for m in _imports(tree) if m.split(".")[0] == "tests"]
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "path"
                and isinstance(node.value, ast.Name)
                and node.value.id == "sys"
            ):
                found.append(f"{name}:{node.lineno} uses sys.path")
    assert found == []
