"""What is served is what was verified: a model file changed, truncated or swapped
under a running process changes no answer and kills no worker.

Oracles: the answers given before the change (compared to the last bit), the
process's own memory maps (``/proc/self/maps`` names every file a process maps), the
worker pids the service reports, and the verification's own refusal at a reload.
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from bagserve.core import ArtifactError, estimator_state
from bagserve.core.artifacts import load, read_manifest, read_verified
from bagserve.core.demo import build_demo_models, demo_samples
from bagserve.core.runtime import ModelRuntime
from bagserve.core.sealing import MemoryWriter, SealedMemory, npy_array
from bagserve.core.signing import SignatureError, load_trusted_keys, sign_model, verify_model

from .service_harness import running_service
from .test_signing import keypair

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="sealed shared memory is Linux's (memfd)"
)

#: Wide bounds: a CI machine at load 10+ is slow, never this slow.
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("integrity") / "models"
    build_demo_models(directory)
    return directory


@pytest.fixture
def models(built, tmp_path) -> Path:
    import shutil

    repo = tmp_path / "models"
    shutil.copytree(built, repo)
    return repo


def array_file(models: Path, name: str, array: str) -> Path:
    return models / name / "1" / "arrays" / f"model.{array}.npy"


def flip_one_byte(path: Path, offset_from_end: int = 2) -> None:
    """Flip one byte of a float's mantissa in place: same size, same mtime (what a
    bit rot, a careless editor or an attacker hiding their tracks leaves)."""
    before = path.stat()
    with path.open("r+b") as f:
        f.seek(before.st_size - offset_from_end)
        byte = f.read(1)[0]
        f.seek(before.st_size - offset_from_end)
        f.write(bytes([byte ^ 0x10]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def truncate_in_place(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)


def dose_body() -> dict:
    bags, _, markers = demo_samples("dose", 2, 3)
    return {
        "bags": [
            {"id": f"b{i}", "markers": markers, "points": np.asarray(b).tolist()}
            for i, b in enumerate(bags)
        ]
    }


def gating_body() -> dict:
    bags, _, markers = demo_samples("gating", 1, 3)
    return {"bags": [{"id": "g", "markers": markers, "points": np.asarray(bags[0]).tolist()}]}


def predict(url: str, name: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/models/{name}/predict", json=body, timeout=TIMEOUT)


def worker_pids(url: str) -> list[int]:
    return sorted(httpx.get(f"{url}/readyz", timeout=TIMEOUT).json()["workers"]["pids"])


def artifact_maps(path: Path, pid: int | str = "self") -> list[str]:
    """Lines of a process's memory maps that map a file under ``path``."""
    where = str(path.resolve())
    return [ln for ln in Path(f"/proc/{pid}/maps").read_text().splitlines() if where in ln]


def model_memory(pid: int) -> set[str]:
    """The inodes of the sealed model memory files a process maps."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {ln.split()[4] for ln in lines if "memfd:bagserve-model" in ln}


# ------------------------------------------------------------------ the library
@pytest.mark.parametrize("mmap", [False, True])
def test_a_loaded_model_is_not_backed_by_its_files(models, mmap):
    """The arrays a runtime computes with are verified bytes in memory of the process
    (private, or sealed shared memory with ``mmap=True``), never a map of the files:
    the files changed, then truncated, change none of its answers."""
    path = models / "demo-dose" / "1"
    runtime = ModelRuntime.open(path, mmap=mmap)
    assert artifact_maps(path) == []
    bags, _, _ = demo_samples("dose", 3, 5)
    before = runtime.predict(bags)
    flip_one_byte(array_file(models, "demo-dose", "intercept"))
    flip_one_byte(array_file(models, "demo-dose", "dual_coef"))
    truncate_in_place(array_file(models, "demo-dose", "train_embedding_.features"))
    after = runtime.predict(bags)
    assert after.values.tobytes() == before.values.tobytes()
    assert after.domain.score.tobytes() == before.domain.score.tobytes()
    # What is on disk now no longer verifies, wherever it is read.
    with pytest.raises(ArtifactError, match="does not match its sha256"):
        ModelRuntime.open(path, mmap=mmap)
    with pytest.raises(ArtifactError, match="does not match its sha256"):
        load(path, mmap=mmap)


def test_a_file_changed_between_its_verification_and_its_use_is_not_used(models, monkeypatch):
    """The race a verify-then-read loader loses: the files change once hashed, before
    the arrays are built. The runtime computes from the bytes it hashed."""
    path = models / "demo-dose" / "1"
    bags, _, _ = demo_samples("dose", 3, 5)
    expected = ModelRuntime.open(path).predict(bags)
    decoder = estimator_state.StateDecoder.__init__

    def raced(self, load_array):
        flip_one_byte(array_file(models, "demo-dose", "intercept"))
        decoder(self, load_array)

    monkeypatch.setattr(estimator_state.StateDecoder, "__init__", raced)
    got = ModelRuntime.open(path).predict(bags)
    assert got.values.tobytes() == expected.values.tobytes()


def test_a_signature_is_bound_to_the_bytes_read(models, tmp_path):
    """model-signing hashes the files on disk; the bytes served must be the ones it
    signs: digests of other bytes are refused, naming the file."""
    private, public = keypair(tmp_path, "lab-qa")
    path = models / "demo-dose" / "1"
    sign_model(path, private)
    keys = load_trusted_keys([str(public)])
    verified = read_verified(path, shared=True, mapped=False)
    assert verify_model(path, keys, digests=verified.digests).name == "lab-qa"
    other = {**verified.digests, "arrays/model.intercept.npy": "0" * 64}
    with pytest.raises(SignatureError, match=r"model\.intercept\.npy changed while it was being"):
        verify_model(path, keys, digests=other)


def test_a_pipe_in_place_of_an_array_file_is_refused_at_once(models):
    """A named pipe put where an array was would hold a reader forever: refused
    without waiting for a writer (in a process of its own, bounded)."""
    path = models / "demo-dose" / "1"
    victim = array_file(models, "demo-dose", "intercept")
    victim.unlink()
    os.mkfifo(victim)
    code = (
        "from bagserve.core.runtime import ModelRuntime\n"
        f"try:\n    ModelRuntime.open({str(path)!r})\n"
        "except Exception as exc:\n    print(type(exc).__name__, exc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert done.stdout.startswith("ArtifactError"), done.stdout + done.stderr
    assert "model.intercept.npy: not a regular file" in done.stdout


def test_shared_arrays_are_sealed_read_only_memory(models):
    """``mmap=True`` arrays lie in one anonymous memory file that nothing can write:
    read-only arrays, on a mapping of a memfd, whatever the files do."""
    path = models / "demo-gating" / "1"
    model = load(path, mmap=True)
    arrays = [v for v in vars(model).values() if isinstance(v, np.ndarray) and v.size]
    assert arrays and not any(a.flags.writeable for a in arrays)
    assert all(a.ctypes.data % 64 == 0 for a in arrays)
    with pytest.raises(ValueError, match="read-only"):
        arrays[0][...] = 0
    maps = Path("/proc/self/maps").read_text().splitlines()
    anonymous = [ln for ln in maps if "memfd:bagserve-model" in ln]
    assert anonymous and all(ln.split()[1].startswith("r-") for ln in anonymous)
    assert read_manifest(path)["files"]  # the artifact itself is untouched


def test_sealed_memory_cannot_be_changed_even_by_its_creator():
    """Once sealed, the memory file refuses writes, new writable maps and resizing to
    everyone (the kernel's seals, checked with plain system calls); a memory file
    without the seals is refused by the processes it is handed to."""
    writer = MemoryWriter(4096, shared=True)
    writer.write(0, b"abc")
    memory = writer.finish()
    fd = memory.fd
    assert fd is not None and bytes(memory.view[:3]) == b"abc"
    with pytest.raises(PermissionError):
        os.pwrite(fd, b"x", 0)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 1)
    with pytest.raises(PermissionError):
        mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    assert bytes(SealedMemory.attach(os.dup(fd), 4096).view[:3]) == b"abc"
    with pytest.raises(ValueError, match="size"):
        SealedMemory.attach(os.dup(fd), 8192)
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, 4096)
    with pytest.raises(ValueError, match="not sealed"):
        SealedMemory.attach(unsealed, 4096)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12.0).reshape(3, 4),
        np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4)),
        np.array(["CD4+", "B cell"]),
        np.zeros((0, 3)),
        np.array(3.5),
        np.zeros(3, dtype=[("a", "<f4"), ("b", "<i8")]),
    ],
)
def test_npy_bytes_read_in_memory_as_np_load_reads_the_file(tmp_path, array):
    path = tmp_path / "a.npy"
    np.save(path, array, allow_pickle=False)
    data = path.read_bytes()
    expected = np.load(path, allow_pickle=False)
    got = npy_array(memoryview(data))
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert got.tobytes(order="A") == expected.tobytes(order="A")
    assert got.flags.f_contiguous == expected.flags.f_contiguous
    if array.nbytes:
        with pytest.raises(ValueError, match="bytes of data"):
            npy_array(memoryview(data[:-1]))


def test_npy_bytes_refuse_what_np_load_refuses(tmp_path):
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="object arrays"):
        npy_array(memoryview((tmp_path / "o.npy").read_bytes()))
    with pytest.raises(ValueError, match="magic string"):
        npy_array(memoryview(b"not an npy file at all"))


# ------------------------------------------------------------------ the service
def test_a_model_changed_in_place_under_the_service_answers_as_verified(models):
    """One byte flipped in a served model's array (same size and mtime), then the file
    truncated: every answer stays the verified model's to the last bit, no worker dies,
    no request hangs, the other model answers; a reload refuses the changed files with
    the reason and the verified copy keeps answering."""
    dose, gating = dose_body(), gating_body()
    with running_service(models) as url:
        first = predict(url, "demo-dose", dose)
        other = predict(url, "demo-gating", gating)
        assert first.status_code == 200 and other.status_code == 200
        pids = worker_pids(url)
        assert len(pids) == 2
        # Neither worker maps a model file; both map the same sealed memory (one copy).
        assert all(artifact_maps(models, pid) == [] for pid in pids)
        shared = [model_memory(pid) for pid in pids]
        assert len(shared[0]) == 2 and shared[0] == shared[1]
        flip_one_byte(array_file(models, "demo-dose", "intercept"))
        flip_one_byte(array_file(models, "demo-dose", "dual_coef"))
        flipped = predict(url, "demo-dose", dose)
        assert flipped.status_code == 200, flipped.text
        assert flipped.json()["predictions"] == first.json()["predictions"]
        assert flipped.headers["x-model-sha256"] == first.headers["x-model-sha256"]
        truncate_in_place(array_file(models, "demo-dose", "train_embedding_.features"))
        for _ in range(4):  # both workers, twice
            t0 = time.monotonic()
            again = predict(url, "demo-dose", dose)
            assert time.monotonic() - t0 < TIMEOUT
            assert again.status_code == 200, again.text
            assert again.json()["predictions"] == first.json()["predictions"]
            also = predict(url, "demo-gating", gating)
            assert also.json()["predictions"] == other.json()["predictions"]
        assert worker_pids(url) == pids
        # A reload reads the files again: refused, named, and the verified copy serves.
        refused = httpx.post(
            f"{url}/v2/repository/models/demo-dose/load",
            headers={"Prefer": "wait=60"},
            timeout=TIMEOUT + 30,
        )
        assert refused.status_code == 404, refused.text
        assert "does not match its sha256" in str(refused.json())
        rows = httpx.post(f"{url}/v2/repository/index", timeout=TIMEOUT).json()
        (row,) = [r for r in rows if r["name"] == "demo-dose"]
        assert row["state"] == "READY" and "no longer verif" in row["reason"]
        assert "sha256" in row["reason"] and str(models) not in row["reason"]
        kept = predict(url, "demo-dose", dose)
        assert kept.json()["predictions"] == first.json()["predictions"]
        assert worker_pids(url) == pids


def test_a_signed_model_answers_from_the_bytes_its_signature_verified(tmp_path, models):
    """With release keys: the flipped byte changes neither the answer nor its signer;
    a full reload (SIGHUP) refuses the release with the signature's reason while the
    other model keeps answering."""
    keys = tmp_path / "keys"
    keys.mkdir()
    private, public = keypair(keys, "lab-qa")
    for name in ("demo-dose", "demo-gating"):
        sign_model(models / name / "1", private)
    dose, gating = dose_body(), gating_body()
    with running_service(models, BAGSERVE_TRUSTED_KEYS=f"lab QA={public}") as url:
        first = predict(url, "demo-dose", dose)
        assert first.json()["model"]["signer"]["signer"] == "lab QA"
        pids = worker_pids(url)
        flip_one_byte(array_file(models, "demo-dose", "dual_coef"))
        truncate_in_place(array_file(models, "demo-dose", "train_embedding_.features"))
        for _ in range(4):
            again = predict(url, "demo-dose", dose)
            assert again.status_code == 200, again.text
            assert again.json()["predictions"] == first.json()["predictions"]
            assert again.json()["model"] == first.json()["model"]
        assert worker_pids(url) == pids
        os.kill(url.pid, signal.SIGHUP)
        deadline = time.monotonic() + TIMEOUT
        while (
            "demo-dose/1" not in httpx.get(f"{url}/v1/models", timeout=TIMEOUT).json()["failures"]
        ):
            assert time.monotonic() < deadline, "the reload did not refuse the changed release"
            time.sleep(0.2)
        failures = httpx.get(f"{url}/v1/models", timeout=TIMEOUT).json()["failures"]
        assert "sha256" in failures["demo-dose/1"]
        refused = predict(url, "demo-dose", dose)
        assert refused.status_code == 404
        assert predict(url, "demo-gating", gating).status_code == 200
        assert worker_pids(url) == pids
