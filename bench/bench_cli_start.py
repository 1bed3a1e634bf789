"""Start-up time of the ``bagserve`` command and of the imports a pipeline needs.

Run with ``make bench`` (or ``.venv/bin/python bench/bench_cli_start.py [--quick]``).
Each command runs in a fresh process, the commands taking turns (round robin) so that
a burst of load on this shared machine hits all of them alike; the table gives each
command's median wall time and its ratio to ``python -c pass`` measured in the same
rounds (the interpreter's own start-up, the floor of any command). Writes
``bench/results/bench_cli_start.json``.

``bagserve models list`` reads a one-model directory and ``bagserve audit verify`` a
211-record SQLite trail (the size in the issue that asked for this), both created
here in a temporary directory.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _report import report

BIN = Path(sys.executable).parent


def _make_model(models: Path) -> None:
    """A small saved model (sliced-Wasserstein ridge on 20 bags of 3 markers)."""
    import numpy as np
    from bagserve.core import DistributionRidge, SlicedWasserstein, save

    rng = np.random.default_rng(0)
    bags = [rng.normal(size=(30, 3)) for _ in range(20)]
    y = np.array([b.mean() for b in bags])
    model = DistributionRidge(SlicedWasserstein(random_state=0), gamma=0.1, alpha=1e-2)
    save(
        model.fit(bags, y),
        models / "toy" / "1",
        name="toy",
        version="1",
        panel={"markers": ["a", "b", "c"]},
        metrics={"rmse": 0.1},
    )


def _make_audit(data_dir: Path, n_records: int) -> None:
    """An audit trail of ``n_records`` records, as the service writes it."""
    from bagserve.service.audit import AuditLog
    from bagserve.service.database import Database

    log = AuditLog(Database(None, data_dir, pool_size=1))
    try:
        for i in range(n_records):
            log.append(request_id=f"r{i}", api_key_id=None, route="/v1/x", status=200)
    finally:
        log.db.close()


def commands(tmp: Path) -> dict[str, list[str]]:
    """The command lines timed, by label (the first is the baseline)."""
    models, data_dir = tmp / "models", tmp / "data"
    _make_model(models)
    _make_audit(data_dir, 211)
    exe, py = str(BIN / "bagserve"), sys.executable
    return {
        "python -c pass": [py, "-c", "pass"],
        "bagserve --version": [exe, "--version"],
        "bagserve --help": [exe, "--help"],
        "bagserve models list": [exe, "models", "list", str(models)],
        "bagserve audit verify (211 records)": [
            exe,
            "audit",
            "verify",
            "--data-dir",
            str(data_dir),
        ],
        "import bagserve.core": [py, "-c", "import bagserve.core"],
        "import bagserve.service.client": [py, "-c", "import bagserve.service.client"],
        "from bagserve.core import DistributionRidge": [
            py,
            "-c",
            "from bagserve.core import DistributionRidge",
        ],
    }


def time_commands(cmds: dict[str, list[str]], rounds: int, cwd: Path) -> dict[str, list[float]]:
    """Wall seconds of every command, ``rounds`` times each, the commands taking turns.

    They run in ``cwd``, away from the source tree: ``python -c`` puts the working
    directory first on the path, where the repository's ``bagserve/`` folder (without
    ``core/``) would shadow the installed package.
    """
    times: dict[str, list[float]] = {label: [] for label in cmds}
    for argv in cmds.values():  # one untimed run each: the OS caches the files
        subprocess.run(argv, check=True, capture_output=True, cwd=cwd)
    for _ in range(rounds):
        for label, argv in cmds.items():
            t0 = time.perf_counter()
            subprocess.run(argv, check=True, capture_output=True, cwd=cwd)
            times[label].append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="3 rounds (a smoke run)")
    parser.add_argument("--rounds", type=int, default=15, help="runs of each command (15)")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        times = time_commands(commands(Path(tmp)), rounds, Path(tmp))
    floor = statistics.median(times["python -c pass"])
    results: list[dict[str, Any]] = []
    for label, ts in times.items():
        median = statistics.median(ts)
        results.append(
            {
                "case": label,
                "median_s": median,
                "min_s": min(ts),
                "max_s": max(ts),
                "ratio_to_python_c_pass": median / floor,
                "rounds": rounds,
            }
        )
    report(results, "bench_cli_start", save=not args.quick)
    width = max(len(r["case"]) for r in results)
    print(f"\n{'command':{width}s}  median s  x python -c pass")
    for r in results:
        print(f"{r['case']:{width}s}  {r['median_s']:8.3f}  {r['ratio_to_python_c_pass']:8.1f}")


if __name__ == "__main__":
    main()
