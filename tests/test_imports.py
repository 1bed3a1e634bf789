"""What each command and each light entry point imports: only what it uses.

``bagserve --version`` once took 7.8 s because every command imported scikit-learn,
scipy and the artifact stack before parsing its arguments. Each test here runs one
command (or one import) in a fresh interpreter and compares the heavy third-party
packages left in ``sys.modules`` with exactly the set that command needs, so a
top-level ``import sklearn`` in ``bagserve/cli/`` (or an eager re-export in a
package ``__init__``) fails here by name.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

#: Third-party packages slow to import, or needed by one door of bagserve only.
HEAVY = frozenset(
    {
        "anndata",
        "cryptography",
        "dask",
        "distributed",
        "fastapi",
        "flowio",
        "flowutils",
        "hl7apy",
        "httpx",
        "joblib",
        "matplotlib",
        "model_signing",
        "numpy",
        "orjson",
        "pandas",
        "psycopg",
        "pyarrow",
        "pydantic",
        "pydantic_settings",
        "scipy",
        "sklearn",
        "starlette",
        "threadpoolctl",
        "uvicorn",
    }
)

# Runs the command line as the ``bagserve`` script does, then prints the top-level
# packages imported (stdout's last line; the command's own output comes before it).
_CLI = textwrap.dedent(
    """
    import sys
    from bagserve.cli import main
    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:  # --version and --help exit from argparse
        code = exc.code
    print(repr((code, sorted({m.partition(".")[0] for m in sys.modules}))))
    """
)


def _heavy(code: str, args: list[str], cwd: Path) -> tuple[object, set[str]]:
    """Exit code and heavy packages loaded by ``python -c code args...`` in ``cwd``.

    ``cwd`` is outside the repository: ``python -c`` puts the working directory first
    on the path, where the source tree's ``bagserve/`` folder would shadow the package.
    """
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd, check=True
    )
    status, modules = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    return status, set(HEAVY.intersection(modules))


def _cli(args: list[str], cwd: Path) -> tuple[object, set[str]]:
    return _heavy(_CLI, args, cwd)


def _imported(statement: str, cwd: Path) -> set[str]:
    listing = "print(repr((0, sorted(m.partition('.')[0] for m in sys.modules))))"
    code = f"import sys; {statement}; {listing}"
    return _heavy(code, [], cwd)[1]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A models directory with one small saved model, and a 30-record audit trail."""
    from bagserve.core import DistributionRidge, SlicedWasserstein, save
    from bagserve.service.audit import AuditLog
    from bagserve.service.database import Database

    root = tmp_path_factory.mktemp("imports")
    rng = np.random.default_rng(0)
    bags = [rng.normal(size=(20, 3)) for _ in range(12)]
    y = np.array([b.mean() for b in bags])
    model = DistributionRidge(SlicedWasserstein(random_state=0), gamma=0.1, alpha=0.01)
    save(model.fit(bags, y), root / "models" / "toy" / "1", panel={"markers": ["a", "b", "c"]})
    from bagserve.core import MarginalTransferClassifier

    cells = MarginalTransferClassifier(calibrate="none", cell_model="linear", random_state=0)
    labels = [(b[:, 0] > 0).astype(int) for b in bags]
    save(
        cells.fit(bags, labels), root / "models" / "cells" / "1", panel={"markers": ["a", "b", "c"]}
    )
    log = AuditLog(Database(None, root / "data", pool_size=1))
    for i in range(30):
        log.append(request_id=f"r{i}", api_key_id=None, route="/v1/x", status=200)
    log.db.close()
    return root


@pytest.mark.parametrize("flag", ["--version", "--help"])
def test_version_and_help_import_no_heavy_package(flag, workdir):
    status, heavy = _cli([flag], workdir)
    assert status == 0
    assert heavy == set()


def test_models_list_reads_manifests_with_numpy_only(workdir):
    status, heavy = _cli(["models", "list", str(workdir / "models")], workdir)
    assert status == 0
    assert heavy == {"numpy"}


def test_describing_a_model_imports_no_estimator(workdir):
    """The server describes every model on its event loop (``GET /v1/models``): the
    first call for a per-cell model once imported scikit-learn there, 1-1.7 s with
    every request waiting."""
    statement = (
        "from bagserve.core.artifact_info import ArtifactInfo; "
        f"ArtifactInfo.read({str(workdir / 'models' / 'cells' / '1')!r}).describe()"
    )
    assert _imported(statement, workdir) == {"numpy"}


def test_audit_verify_needs_the_settings_only(workdir):
    """The auditor reads the service's settings (pydantic) and SQLite: no numerics, no
    web framework."""
    status, heavy = _cli(["audit", "verify", "--data-dir", str(workdir / "data")], workdir)
    assert status == 0
    assert heavy == {"pydantic", "pydantic_settings"}


def test_the_client_needs_httpx_only(workdir):
    assert _imported("from bagserve.service.client import Client", workdir) == {"httpx"}


def test_importing_the_core_package_loads_nothing_heavy(workdir):
    """``import bagserve.core`` is cheap; a public name brings in its own module only."""
    assert _imported("import bagserve.core", workdir) == set()
    assert _imported("from bagserve.core import CoreError, ArtifactError", workdir) == set()
    assert "sklearn" in _imported("from bagserve.core import DistributionRidge", workdir)


def test_the_core_still_exports_its_public_names():
    import bagserve.core as core
    from bagserve.core import bags, errors, estimators, kernels, representations

    assert set(core.__all__) == {*core._EXPORTS, "__version__"}
    namespace: dict[str, object] = {}
    exec("from bagserve.core import *", namespace)
    assert set(core.__all__) <= set(namespace)
    assert core.DistributionRidge is estimators.DistributionRidge
    assert core.ArtifactError is errors.ArtifactError and core.Bags is bags.Bags
    assert core.MeanEmbedding is representations.MeanEmbedding
    assert core.get_kernel is kernels.get_kernel
    with pytest.raises(AttributeError, match="no_such_name"):
        core.no_such_name  # noqa: B018 - the attribute access is the test


def test_the_manifest_kinds_table_agrees_with_the_class_hierarchy():
    """``ArtifactInfo.kind`` and ``classifies`` answer from a table of class names so
    that listing models imports no estimator; it must say what :func:`kind_of` and the
    classes' hierarchy say."""
    from bagserve.core.artifact_info import _KNOWN, kind_of
    from bagserve.core.estimator_state import registry as _registry
    from sklearn.base import ClassifierMixin

    for name, (kind, classifies) in _KNOWN.items():
        assert kind_of(_registry()[name]) is kind, name
        assert issubclass(_registry()[name], ClassifierMixin) is classifies, name
    estimators = {n for n, c in _registry().items() if hasattr(c, "predict")}
    assert estimators == set(_KNOWN)
