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
