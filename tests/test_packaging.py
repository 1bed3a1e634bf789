"""Packaging: the wheel holds what the editable install exposes and builds without
setuptools warnings; the lock files cover pyproject.toml; the image's environment (built
by `make image-env` as the Dockerfile installs, in CI) is that wheel on that lock."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

import bagserve

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ROOT / "requirements"
#: The image's platform, the one every lock is resolved for (Makefile: UV_COMPILE).
PLATFORM = {
    "python_version": "3.11",
    "python_full_version": "3.11.7",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
#: What `make image-env` built (CI sets it): the wheel installed from the image's lock.
IMAGE_ENV = os.environ.get("BAGSERVE_IMAGE_ENV")


@cache
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def dockerfile_copies() -> list[str]:
    """The files and folders the Dockerfile's build stage copies from the context."""
    names = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            names += line.split()[1:-1]
    return names


def copy_sources(dest: Path) -> Path:
    """What the Dockerfile copies, into a fresh folder: a stale build/ of the work tree
    must not decide what the wheel holds."""
    dest.mkdir()
    for name in dockerfile_copies():
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, dest / name)
    return dest


def build_wheel(src: Path, out: Path) -> tuple[Path, str]:
    """``pip wheel`` of ``src`` (verbose: the build backend's output is kept)."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        check=True,
    )
    (wheel,) = out.glob("bagserve-*.whl")
    return wheel, done.stdout + done.stderr


def setuptools_warnings(output: str) -> list[str]:
    """The warnings a build printed (``SetuptoolsDeprecationWarning: ...``,
    ``BuildBackendWarning: ...``): pip's own upper-case ``WARNING:`` lines about the
    machine's indexes are not the package's."""
    return re.findall(r"\b[A-Z][a-z]\w*Warning: .*", output)


def exposed_files(root: Path = ROOT) -> set[str]:
    """What the editable install exposes, named as in the wheel: every file under the
    folders that pyproject.toml maps to bagserve's packages (caches aside)."""
    folders = {"bagserve": "bagserve", **pyproject()["tool"]["setuptools"]["package-dir"]}
    files = set()
    for package, folder in folders.items():
        prefix = package.replace(".", "/")
        for path in (root / folder).rglob("*"):
            rel = path.relative_to(root / folder)
            if path.is_file() and "__pycache__" not in rel.parts:
                files.add(f"{prefix}/{rel.as_posix()}")
    return files


def package_files(names: list[str]) -> set[str]:
    """The wheel's (or an installation's) files of the package, metadata aside."""
    return {n for n in names if n.startswith("bagserve/") and "__pycache__" not in n}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("wheel")
    return build_wheel(copy_sources(tmp / "src"), tmp)


def test_editable_install_reads_the_mapped_folders():
    # The premise of exposed_files: this interpreter imports the work tree's folders.
    import bagserve.core
    import bagserve.service

    assert Path(bagserve.__file__).parent == ROOT / "bagserve"
    assert Path(bagserve.core.__file__).parent == ROOT / "core"
    assert Path(bagserve.service.__file__).parent == ROOT / "service"


def test_wheel_carries_the_files_of_the_editable_install(built):
    wheel, _ = built
    shipped = package_files(zipfile.ZipFile(wheel).namelist())
    exposed = exposed_files()
    assert not exposed - shipped, f"not in the wheel (declare them): {exposed - shipped}"
    assert not shipped - exposed, f"only in the wheel: {shipped - exposed}"


def test_wheel_builds_without_setuptools_warnings(built):
    _, output = built
    assert "Created wheel for bagserve" in output
    assert setuptools_warnings(output) == []


def test_an_undeclared_asset_folder_fails_both_checks(tmp_path):
    """The checks above catch a new asset folder in neither `packages` nor package-data,
    and a folder shipped through its parent's package-data without being a package."""
    src = copy_sources(tmp_path / "src")
    (src / "service" / "static" / "fonts").mkdir()
    (src / "service" / "static" / "fonts" / "a.woff2").write_bytes(b"wOF2")
    config = (src / "pyproject.toml").read_text()
    config = config.replace('    "bagserve.service.static.console",\n', "")
    config = config.replace(
        '"bagserve.service.static" = ["*"]', '"bagserve.service.static" = ["*", "console/*"]'
    )
    (src / "pyproject.toml").write_text(config)
    wheel, output = build_wheel(src, tmp_path)
    shipped = package_files(zipfile.ZipFile(wheel).namelist())
    assert exposed_files(src) - shipped == {"bagserve/service/static/fonts/a.woff2"}
    absent = [w for w in setuptools_warnings(output) if "absent from the `packages`" in w]
    assert absent and all("'bagserve.service.static.console'" in w for w in absent)


def test_wheel_installs_one_bagserve_package(built):
    wheel, _ = built
    names = zipfile.ZipFile(wheel).namelist()
    assert "bagserve/core/__init__.py" in names and "bagserve/service/app.py" in names
    assert "bagserve/cli/__init__.py" in names
    assert "bagserve/core/estimators/transfer/estimator.py" in names
    assert "bagserve/core/estimators/transfer/legacy/estimator.py" in names
    # The pages' assets ship with the package (offline docs and console).
    for asset in (
        "static/console/index.html",
        "static/console/console.js",
        "static/vendor/swagger-ui/swagger-ui-bundle.js",
        "static/vendor/redoc/redoc.standalone.js",
        "static/vendor/redoc/LICENSE",
    ):
        assert f"bagserve/service/{asset}" in names, asset
    # Nothing lands as a top-level `core` or `service`: PyPI's `service` package, or a
    # lab repository's own `core/` folder, would otherwise replace or shadow ours.
    top = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert top == {"bagserve"}, top
    assert any(n.endswith("entry_points.txt") for n in names)


# ------------------------------------------------------------------ lock files
def read_lock(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, sha256 hashes) of a hashed lock file."""
    pins: dict[str, tuple[str, list[str]]] = {}
    for entry in re.split(r"\n(?=\S)", path.read_text()):
        if entry.startswith("#") or not entry.strip():
            continue
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", entry)
        assert m, f"{path.name}: not an exact pin: {entry.splitlines()[0]}"
        pins[canonicalize_name(m[1])] = (m[2], re.findall(r"--hash=sha256:([0-9a-f]{64})", entry))
    return pins


def unmet(requirements: list[str], extras: set[str], pins: dict[str, tuple]) -> list[str]:
    """The requirements (of the given extras, on the image's platform) a lock's pins
    miss or contradict; extras of a requirement (``uvicorn[standard]``) are not
    followed: the resolver saw them, this check reads pyproject.toml only."""
    problems = []
    for line in requirements:
        req = Requirement(line)
        envs = [dict(PLATFORM, extra=e) for e in extras | {""}]
        if req.marker is not None and not any(req.marker.evaluate(env) for env in envs):
            continue
        pin = pins.get(canonicalize_name(req.name))
        if pin is None:
            problems.append(f"{req.name}: not in the lock")
        elif not req.specifier.contains(Version(pin[0]), prereleases=True):
            problems.append(f"{req.name}: {pin[0]} is not {req.specifier}")
    return problems


def locks_expected() -> dict[str, set[str]]:
    """Lock file name -> the extras it covers: runtime, each extra, the image's EXTRAS."""
    extras = pyproject()["project"]["optional-dependencies"]
    expected = {"runtime": set(), **{name: {name} for name in extras}}
    image = image_extras()
    expected["-".join(image) or "runtime"] = set(image)
    return expected


def image_extras() -> list[str]:
    (default,) = re.findall(r"^ARG EXTRAS=(.*)$", (ROOT / "Dockerfile").read_text(), re.M)
    return [e for e in default.split(",") if e]


def requirements_of(extras: set[str]) -> list[str]:
    project = pyproject()["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    return lines


@pytest.mark.parametrize("name", sorted(locks_expected()))
def test_a_hashed_lock_covers_each_extra(name):
    """Every extra of pyproject.toml (a new one too: `make lock`), the runtime and the
    image's EXTRAS have a lock whose every pin carries its hashes and meets
    pyproject.toml's requirements."""
    path = LOCKS / f"{name}.txt"
    assert path.exists(), f"{path.name} is missing: run make lock"
    pins = read_lock(path)
    assert all(hashes for _, hashes in pins.values())
    assert "bagserve" not in pins
    extras = locks_expected()[name]
    assert unmet(requirements_of(extras), extras, pins) == []


def test_the_lock_check_catches_a_stale_lock():
    pins = read_lock(LOCKS / "runtime.txt")
    numpy = pins["numpy"][0]
    raised = f"numpy>={int(numpy.split('.')[0]) + 1}"
    assert unmet([raised], set(), pins) == [f"numpy: {numpy} is not >={raised.split('>=')[1]}"]
    assert unmet(["flowio>=1.3", "not-locked-yet>=1"], set(), pins) == [
        "not-locked-yet: not in the lock"
    ]
    # A requirement for another platform or extra is not asked of this lock.
    assert unmet(['pywin32>=300; sys_platform == "win32"'], set(), pins) == []
    assert unmet(['pyarrow>=15; extra == "parquet"'], set(), pins) == []
    assert unmet(['pyarrow>=15; extra == "parquet"'], {"parquet"}, pins) != []


def test_build_and_sbom_tools_are_locked():
    build = read_lock(LOCKS / "build.txt")
    for line in pyproject()["build-system"]["requires"]:
        req = Requirement(line)
        assert req.specifier.contains(build[canonicalize_name(req.name)][0])
    assert "pip" in build
    sbom = read_lock(LOCKS / "sbom.txt")
    (tool,) = pyproject()["dependency-groups"]["sbom"]
    assert unmet([tool], set(), sbom) == []


def test_image_installs_the_lock_with_hashes_on_a_pinned_base():
    text = (ROOT / "Dockerfile").read_text()
    lines = text.splitlines()
    froms = [i for i, line in enumerate(lines) if line.startswith("FROM ")]
    assert len(froms) == 2
    for i in froms:
        image = lines[i].split()[1]
        tag, _, digest = image.partition("@")
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), lines[i]
        # The tag it was taken from, in the comment right above.
        assert lines[i - 1].startswith(f"# {tag} "), lines[i - 1]
    assert len({lines[i].split()[1] for i in froms}) == 1
    flat = text.replace("\\\n", " ")
    assert "--require-hashes -r requirements/build.txt" in flat
    assert "--require-hashes -r /wheels/requirements.txt" in flat
    assert "--no-deps /wheels/bagserve-" in flat and "--no-build-isolation" in flat
    # Nothing else is installed unpinned.
    for run in re.findall(r"^RUN (.*)$", flat, re.M):
        for cmd in re.findall(r"pip install[^&]*", run):
            assert "--require-hashes" in cmd or "--no-deps" in cmd, cmd
    assert "requirements" in dockerfile_copies()


# ------------------------------------------------------------ the image's environment
@pytest.fixture(scope="module")
def image_python() -> Path:
    if not IMAGE_ENV:
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs `make image-env` and sets BAGSERVE_IMAGE_ENV (.ci/run)")
        pytest.skip("BAGSERVE_IMAGE_ENV is not set (make image-env builds it)")
    return Path(IMAGE_ENV) / "bin" / "python"


_INSPECT = """
import json, importlib.metadata as md
dist = md.distribution("bagserve")
print(json.dumps({
    "files": [str(f) for f in dist.files],
    "direct_url": dist.read_text("direct_url.json"),
    "location": str(dist.locate_file("bagserve")),
    "installed": {d.metadata["Name"]: d.version for d in md.distributions()},
}))
"""


def test_image_env_is_the_wheel_on_the_lock(image_python, tmp_path):
    """What `make image-env` installed: the package's files are the editable install's,
    from a wheel (not a link to the work tree), with exactly the locked versions."""
    # Isolated, away from the work tree: its bagserve.egg-info would answer otherwise.
    found = json.loads(
        subprocess.run(
            [str(image_python), "-I", "-c", _INSPECT],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    installed_files, exposed = package_files(found["files"]), exposed_files()
    assert installed_files == exposed, (exposed - installed_files, installed_files - exposed)
    assert found["direct_url"] is None or "editable" not in found["direct_url"]
    assert Path(found["location"]).is_relative_to(Path(IMAGE_ENV))
    installed = {canonicalize_name(k): v for k, v in found["installed"].items()}
    lock = read_lock(LOCKS / f"{'-'.join(image_extras()) or 'runtime'}.txt")
    assert {name: installed.get(name) for name in lock} == {n: v for n, (v, _) in lock.items()}
    # Beyond the lock: bagserve and the venv's own installer only.
    assert set(installed) - set(lock) <= {"bagserve", "pip", "setuptools"}
    version = subprocess.run(
        [str(image_python.parent / "bagserve"), "--version"], capture_output=True, text=True
    ).stdout
    assert version.split() == ["bagserve", bagserve.__version__]
