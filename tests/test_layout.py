"""The package layout: one bagserve package, layers that import downwards only."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[str]:
    """Absolute names of the modules a file imports (relative imports resolved)."""
    package = ".".join(["bagserve", *path.relative_to(ROOT).with_suffix("").parts[:-1]]).replace(
        "bagserve.bagserve", "bagserve"
    )
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            names += [module, *(f"{module}.{a.name}" for a in node.names)]
    return names


def test_core_imports_nothing_from_the_service():
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in (ROOT / "core").rglob("*.py")
        for name in _imports(path)
        if name.startswith(("bagserve.service", "service", "fastapi", "uvicorn", "starlette"))
    ]
    assert not offenders, offenders


def _loaded_web_modules(imports: str) -> tuple[str, list[str]]:
    code = (
        f"import sys, bagserve; {imports}; print(bagserve.__version__); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('fastapi', 'starlette', 'uvicorn') or m.startswith('bagserve.service.app')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/"
    ).stdout.split("\n")
    return out[0], ast.literal_eval(out[1])


def test_importing_the_core_loads_no_web_framework():
    version, loaded = _loaded_web_modules("import bagserve.core; from bagserve.core import Bags")
    assert re.fullmatch(r"\d+\.\d+\.\d+", version) and loaded == []


def test_the_client_and_the_audit_check_load_no_web_framework():
    """A lab pipeline (the client) and an auditor (``bagserve audit verify``) need
    neither FastAPI nor uvicorn."""
    _, loaded = _loaded_web_modules(
        "from bagserve.service.client import Client; from bagserve.service.audit import verify"
    )
    assert loaded == []


def test_what_the_workers_run_loads_no_web_framework():
    """The worker processes decode, validate and predict: none of it needs FastAPI,
    which keeps their start-up short and the web layer out of the untrusted bytes."""
    _, loaded = _loaded_web_modules(
        "import bagserve.service.worker, bagserve.service.codecs, bagserve.service.tensors, "
        "bagserve.service.validation, bagserve.service.options, bagserve.service.registry"
    )
    assert loaded == []


def test_no_code_outside_the_runtime_decides_from_class_names():
    """The kind of a model is decided in core/runtime.py only: no other module compares
    estimator class names (the artifact registry maps names to classes, nothing more)."""
    names = "|".join(
        [
            "MarginalTransfer",
            "ConditionalMeanEmbedding",
            "DistributionRidge",
            "Classifier",
            "Regressor",
        ]
    )
    pattern = re.compile(
        rf"""(__name__|\["class"\]|estimator)\s*(==|!=|\.startswith|\.endswith|in)\s*\(?["'].*({names})"""
        rf"""|["']({names})\w*["']\s*(==|!=|in)"""
        rf"""|\.(startswith|endswith)\(["']({names})"""
    )
    offenders = []
    for folder in ("core", "service", "bagserve"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "runtime.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, offenders


# ----------------------------------------------------------------------------- shape
# The folders whose code a newcomer reads, and the package each installs as.
_PACKAGES = {"core": "bagserve.core", "service": "bagserve.service", "bagserve": "bagserve"}
_MAX_MODULE_LINES = 600
_MAX_FUNCTION_LINES = 100
#: Issue 44: marginal transfer is a package of small parts, none over 400 lines.
_TRANSFER = "core/estimators/transfer/"
_MAX_TRANSFER_LINES = 400


def _sources() -> dict[str, Path]:
    """Every Python file of the three folders by its path from the root."""
    return {
        p.relative_to(ROOT).as_posix(): p
        for folder in _PACKAGES
        for p in sorted((ROOT / folder).rglob("*.py"))
    }


def _module_names() -> dict[str, str]:
    """Dotted module name -> path from the root (a package is its ``__init__.py``)."""
    out = {}
    for rel in _sources():
        folder, *parts = rel.removesuffix(".py").split("/")
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([_PACKAGES[folder], *parts])] = rel
    return out


def _import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules of the three folders it imports anywhere: at the top, in a
    function or under ``if TYPE_CHECKING`` (a deferred import is still a dependency).
    ``from a import b`` is an edge to ``a.b`` when that is a module, else to ``a``."""
    graph: dict[str, set[str]] = {}
    for name, rel in modules.items():
        package = name if rel.endswith("__init__.py") else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                found = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            else:
                continue
            for target in found:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_in_core_service_or_the_command():
    """Every import counts, also one inside a function or under TYPE_CHECKING: a cycle
    hidden by a deferred import is still two modules that cannot be read apart."""
    assert _cycles(_import_graph(_module_names())) == []


def test_the_cycle_check_finds_a_deferred_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _function_lengths(tree: ast.AST) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every function and method: from its first
    decorator to its last line, its docstring aside (a numpydoc docstring is
    documentation, not code a reader must hold in mind)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = node.end_lineno - first + 1
            doc = node.body[0]
            is_doc = isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
            if is_doc and isinstance(doc.value.value, str):
                length -= doc.end_lineno - doc.lineno + 1
            out.append((node.name, first, length))
    return out


def test_modules_and_functions_fit_in_a_readers_mind():
    """No module over 600 lines (400 in marginal transfer's package), no function over
    100 (docstring aside), in core, service and bagserve: past that, split along the
    concepts (docs/development.md)."""
    too_long = []
    for rel, path in _sources().items():
        text = path.read_text()
        n = len(text.splitlines())
        if n > (_MAX_TRANSFER_LINES if rel.startswith(_TRANSFER) else _MAX_MODULE_LINES):
            too_long.append(f"{rel}: {n} lines")
        too_long += [
            f"{rel}:{line}: {name}() has {length} lines"
            for name, line, length in _function_lengths(ast.parse(text))
            if length > _MAX_FUNCTION_LINES
        ]
    assert not too_long, too_long


def test_the_size_check_can_fail():
    code = 'def f():\n    """Doc.\n\n    More."""\n' + "    x = 1\n" * 100
    ((name, first, length),) = _function_lengths(ast.parse(code))
    assert (name, first, length) == ("f", 1, 101)


def _borrowed_attributes(tree: ast.Module) -> dict[str, list[str]]:
    """Each class that inherits nothing, to the attributes it reads on ``self`` without
    defining them (in its body or by assigning them): what a mixin takes from the
    classes it is mixed into."""
    out = {}
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef) or any(
            not (isinstance(b, ast.Name) and b.id == "object") for b in cls.bases
        ):
            continue
        own = set()
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                own.add(node.target.id)
            elif isinstance(node, ast.Assign):
                own.update(t.id for t in node.targets if isinstance(t, ast.Name))
        read = set()
        for node in ast.walk(cls):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                (own if isinstance(node.ctx, ast.Store) else read).add(node.attr)
        borrowed = sorted(a for a in read - own if not a.startswith("__"))
        if borrowed:
            out[cls.name] = borrowed
    return out


def test_parts_talk_through_inputs_not_mixins():
    """A part of a larger object (the worker pool's lifecycle, placement and
    dispatch) gets what it needs as arguments; none reads state that only the class
    it is mixed into defines (docs/development.md)."""
    mixins = [
        f"{rel}: {name} reads {', '.join(attrs)}"
        for rel, path in _sources().items()
        for name, attrs in _borrowed_attributes(ast.parse(path.read_text())).items()
    ]
    assert not mixins, mixins


def test_the_mixin_check_can_fail():
    code = (
        "class Part:\n"
        "    n: int\n"
        "    def __init__(self):\n"
        "        self.size = 1\n"
        "    def go(self):\n"
        "        return self.n + self.size + self.other + self.go()\n"
        "class Whole(Part):\n"
        "    def run(self):\n"
        "        return self.inherited\n"
    )
    assert _borrowed_attributes(ast.parse(code)) == {"Part": ["other"]}


def _layout_entries() -> dict[str, str]:
    """docs/development.md's layout map: each entry's path (``core/io/``,
    ``core/bags.py``) -> its text (names and description, continuation lines
    included). An entry starts before the description column; its depth is its
    indent / 2; ``a.py, b.py`` names several files with one description."""
    text = (ROOT / "docs" / "development.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    folders: list[str] = []
    current: list[str] = []
    for line in block.splitlines():
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if not stripped:
            continue
        if indent >= 22:  # a continuation of the entry above
            for name in current:
                entries[name] += " " + stripped
            continue
        depth = indent // 2
        names, _, description = stripped.partition("  ")
        folders = folders[:depth]
        current = ["".join(folders) + name.strip() for name in names.split(", ") if name.strip()]
        for name in current:
            entries[name] = stripped + " " + description
        if len(current) == 1 and current[0].endswith("/"):
            folders.append(names.strip())
    return entries


def _undocumented(entries: dict[str, str], files: list[str]) -> list[str]:
    """The files named neither by an entry of their own nor in the text of an entry
    of an enclosing folder or of a neighbour there (``io/  readers.py (...)``,
    ``database.py  ... (postgres.py: its driver)``)."""
    missing = []
    for rel in files:
        parts = rel.split("/")
        named = rel in entries
        for k in range(len(parts) - 1, 0, -1):
            if named:
                break
            folder = "/".join(parts[:k]) + "/"
            near = [
                text
                for key, text in entries.items()
                if key.startswith(folder) and "/" not in key[len(folder) :]
            ]
            pattern = rf"(?<![\w/.]){re.escape('/'.join(parts[k:]))}(?!\w)"
            named = any(re.search(pattern, text) for text in [entries.get(folder, ""), *near])
        if not named:
            missing.append(rel)
    return missing


def test_the_layout_map_names_every_module():
    """docs/development.md's layout map names every module of core, service and
    bagserve (a package by its folder; __init__.py goes without saying), so that a
    newcomer finds each file's purpose there."""
    files = [rel for rel in _sources() if not rel.endswith("__init__.py")]
    assert _undocumented(_layout_entries(), files) == []


def test_the_layout_check_can_fail():
    entries = {"core/": "core/ the library", "core/io/": "io/ readers.py (files)"}
    files = ["core/io/readers.py", "core/io/panel.py", "core/bags.py", "core/fit.py"]
    assert _undocumented(entries, files) == ["core/io/panel.py", "core/bags.py", "core/fit.py"]
    entries["core/bags.py"] = "bags.py  bags (fit.py: their fitting)"
    # A neighbour's text names fit.py; io/'s text does not name core/ files.
    assert _undocumented(entries, files[2:]) == []
    assert _undocumented({"core/io/": "io/ bags.py"}, ["core/bags.py"]) == ["core/bags.py"]


_RESULT_TYPES = {
    "Prediction",
    "RegressionPrediction",
    "ClassificationPrediction",
    "ConditionalPrediction",
    "CellPrediction",
}


def _result_type_checks(source: str) -> list[int]:
    """Lines of ``source`` that test a value against a result type with ``isinstance``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and len(node.args) == 2
        ):
            continue
        kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
        named = {k.id if isinstance(k, ast.Name) else getattr(k, "attr", "") for k in kinds}
        if named & _RESULT_TYPES:
            lines.append(node.lineno)
    return lines


def test_answers_are_shaped_by_dispatch_on_the_result_type():
    """Every output format of the service (JSON, CSV, NPY, FHIR, HL7, /v2 tensors) takes
    its shape from the result's type by dispatch (functools.singledispatch or a method
    of the result), never from an isinstance ladder that a new result type would fall
    through silently."""
    offenders = [
        f"{rel}:{line}"
        for rel, path in _sources().items()
        if rel.startswith("service/")
        for line in _result_type_checks(path.read_text())
    ]
    assert offenders == []


def test_the_result_type_check_can_fail():
    source = (
        "if isinstance(r, CellPrediction):\n    pass\n"
        "elif isinstance(r, (int, results.ClassificationPrediction)):\n    pass\n"
        "ok = isinstance(r, str)\n"
    )
    assert _result_type_checks(source) == [1, 3]


def _outcome_fields_passed(source: str) -> list[int]:
    """Lines of ``source`` that pass a field of an ``outcome`` on as a keyword argument."""
    fields = {"inputs", "plots", "acquired", "explanations"}
    return [
        node.value.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.keyword)
        and isinstance(node.value, ast.Attribute)
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "outcome"
        and node.value.attr in fields
    ]


def test_what_the_formats_take_of_a_prediction_is_bundled_in_one_place():
    """The inputs, plots, acquisition times and explanations of a finished
    prediction reach the output formats as one Answer (Outcome.answer), never
    unpacked into keyword arguments at each door."""
    offenders = [
        f"{rel}:{line}"
        for rel, path in _sources().items()
        if rel.startswith("service/")
        for line in _outcome_fields_passed(path.read_text())
    ]
    assert offenders == []


def test_the_outcome_field_check_can_fail():
    source = "f(outcome.ids, inputs=outcome.inputs, e=outcome.explanations)\ng(inputs=x.inputs)\n"
    assert _outcome_fields_passed(source) == [1, 1]
