"""`bagserve validate`: a saved model run as served on new samples with reference
results, the three files it writes, what the model declined, the refusals."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from bagserve.core import DistributionRidge, SlicedWasserstein, save
from bagserve.core.demo import POPULATIONS, build_demo_models, demo_samples
from bagserve.core.errors import ConfigError, DataError
from bagserve.core.hashing import file_sha256, json_sha256
from bagserve.core.io import Panel, Preprocessing
from bagserve.core.training import bag_fingerprints
from bagserve.core.validation import TrainingSampleError, render_html, validate
from sklearn.metrics import cohen_kappa_score

from bagserve.cli import main
from bagserve.cli.local import predict_files

# The small models fitted here choose at their grids' edges; what is tested is validate.
pytestmark = pytest.mark.filterwarnings("ignore::bagserve.core.selection.GridEdgeWarning")


def _write_bag(path: Path, points: np.ndarray, markers: list[str]) -> Path:
    header = ",".join(markers)
    np.savetxt(path, points, delimiter=",", header=header, comments="", fmt="%.6f")
    return path


@pytest.fixture(scope="module")
def dose_model(tmp_path_factory) -> tuple[Path, list[Path], list[str]]:
    """A small dose model that withholds answers out of its domain, recording its
    training bags (and one of their files, for the refusal)."""
    root = tmp_path_factory.mktemp("dose")
    bags, dose, markers = demo_samples("dose", 30, 3)
    model = DistributionRidge(
        SlicedWasserstein(n_directions=20, n_levels=20, random_state=0), random_state=0
    ).fit(bags, dose)
    files = [_write_bag(root / f"train{i}.csv", bags[i], markers) for i in range(2)]
    names = [f.name for f in files] + [f"gen{i}" for i in range(2, len(bags))]
    digests = [file_sha256(f) for f in files] + [None] * (len(bags) - 2)
    path = save(
        model,
        root / "models" / "dose" / "1",
        name="dose",
        version="1",
        panel=Panel(tuple(markers)).to_json(),
        preprocessing=Preprocessing().to_json(),
        training_bags=bag_fingerprints(names, digests, [bags[i] for i in range(len(bags))]),
        serving={"out_of_domain": "withhold"},
    )
    return path, files, markers


def _dose_study(tmp_path: Path, markers: list[str], limits: str = "") -> tuple[Path, list[float]]:
    bags, dose, _ = demo_samples("dose", 8, 11)
    rows = ["file,dose"]
    for i in range(len(bags)):
        _write_bag(tmp_path / f"s{i}.csv", bags[i], markers)
        rows.append(f"s{i}.csv,{float(dose[i])!r}")
    # One sample unlike every training sample: the model withholds it.
    far = bags[0] * 25.0 + 400.0
    _write_bag(tmp_path / "s8.csv", far, markers)
    rows.append("s8.csv,0.5")
    (tmp_path / "refs.csv").write_text("\n".join(rows) + "\n")
    toml = tmp_path / "validate.toml"
    toml.write_text(
        '[data]\nfiles = "s*.csv"\nlabels = "refs.csv"\nlabel_column = "dose"\n'
        '[report]\nlaboratory = "<b>Lab</b> & Co"\n' + limits
    )
    return toml, [*dose.tolist(), 0.5]


def test_validate_regression_writes_the_three_files(dose_model, tmp_path, capsys):
    path, _, markers = dose_model
    toml, refs = _dose_study(
        tmp_path, markers, "[acceptance]\nbias = [-0.5, 0.5]\nslope = [0.8, 1.2]\nr = [0.0, 1.0]\n"
    )
    out = tmp_path / "out"
    assert main(["validate", str(path), str(toml), "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    doc = json.loads((out / "validation.json").read_text())
    assert summary["verdict"] == doc["verdict"] in ("pass", "fail", "not shown")
    # The model's values are those `bagserve predict` gives for the same files.
    files = sorted(tmp_path.glob("s*.csv"))
    served = predict_files(path, files)["results"]
    rows = doc["per_sample"]
    assert [r["file"] for r in rows] == [f.name for f in files]
    for row, answer, f in zip(rows, served, files, strict=True):
        assert row["status"] == answer["status"]
        assert row["sha256"] == file_sha256(f) == answer["input_sha256"]
        if answer["status"] != "withheld":
            assert row["model"] == answer["prediction"]
    assert [r["reference"] for r in rows] == pytest.approx(refs)
    # The far sample is declined (withheld), counted, listed, and both analyses given.
    samples = doc["samples"]
    assert samples["n"] == 9 and samples["n_declined"] == samples["n_withheld"] == 1
    assert [d["sample"] for d in samples["declined"]] == ["s8.csv"]
    assert samples["declined"][0]["status"] == "withheld"
    everything, kept = doc["quantitative"]["all"][0], doc["quantitative"]["without_declined"][0]
    assert (everything["n"], kept["n"]) == (9, 8)
    d = np.array([r["difference"] for r in rows if not r["declined"]])
    assert kept["bland_altman"]["bias"] == pytest.approx(d.mean())
    assert everything["bland_altman"]["bias"] != pytest.approx(kept["bland_altman"]["bias"])
    # Each limit judged on both sets; slope on both regressions.
    judged = {(r["criterion"], r["statistic"], r["set"]) for r in doc["acceptance"]}
    assert len(judged) == len(doc["acceptance"]) == 2 * (1 + 2 + 1)
    # Inside the limits with its confidence interval: pass; the estimate outside:
    # fail; the estimate inside and its interval not: not shown (CLSI EP09).
    for r in doc["acceptance"]:
        inside = r["low"] <= r["estimate"] <= r["high"]
        ci_inside = r["low"] <= r["ci"][0] and r["ci"][1] <= r["high"]
        want = "fail" if not inside else "pass" if ci_inside else "not shown"
        assert r["verdict"] == want and r["pass"] == (want == "pass")
    verdicts = {r["verdict"] for r in doc["acceptance"]}
    assert doc["verdict"] == (
        "fail" if "fail" in verdicts else "not shown" if "not shown" in verdicts else "pass"
    )
    # Provenance: the model, the files and tables with their sha256, the software.
    assert (
        doc["model"]["sha256"]
        == json.loads((path / "manifest.json").read_text())["manifest_sha256"]
    )
    assert doc["model"]["signer_key_sha256"] is None
    assert {t["name"]: t["sha256"] for t in doc["data"]["tables"]} == {
        "refs.csv": file_sha256(tmp_path / "refs.csv")
    }
    assert doc["data"]["validation_file"]["sha256"] == file_sha256(toml)
    assert doc["software"]["bagserve"] and doc["training_overlap"] == "none"
    assert "precision" in doc and "EP05" in doc["precision"]["note"]
    # The JSON is the document whose digest the page shows.
    assert doc["sha256"] == json_sha256(doc, exclude=("sha256",))
    page = (out / "validation.html").read_text()
    assert page == render_html(doc)
    assert doc["sha256"] in page and doc["model"]["sha256"] in page
    # Self-contained and printable: nothing fetched, no script, a signature block.
    assert not re.search(r"<script|<link|<img|\bsrc=|@import|url\((?!#)", page)
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg\")", page)
    assert "default-src 'none'" in page  # and the browser is told to fetch nothing
    assert "@media print" in page and "Laboratory director" in page and "Signature" in page
    # Outside text is escaped.
    assert "&lt;b&gt;Lab&lt;/b&gt; &amp; Co" in page and "<b>Lab</b>" not in page
    # Every judged estimate and its verdict are on the page, as the JSON has them.
    for r in doc["acceptance"]:
        assert f"{r['estimate']:.4g}" in page
    verdicts = re.findall(r'<td class="(pass|fail|unshown)">(PASS|FAIL|NOT SHOWN)</td>', page)
    assert [v[1] for v in verdicts] == [r["verdict"].upper() for r in doc["acceptance"]]
    assert page.count("<svg") == 2
    table = list(csv.DictReader(io.StringIO((out / "per_sample.csv").read_text())))
    assert [t["sample"] for t in table] == [r["sample"] for r in rows]
    assert [float(t["model"]) for t in table] == [r["model"] for r in rows]
    assert [t["declined"] for t in table] == ["true" if r["declined"] else "false" for r in rows]


def test_training_samples_are_refused(dose_model, tmp_path):
    path, train_files, markers = dose_model
    toml, _ = _dose_study(tmp_path, markers)
    (tmp_path / "s3.csv").write_bytes(train_files[1].read_bytes())
    with pytest.raises(TrainingSampleError, match=r"s3\.csv"):
        validate(path, toml)


def test_every_file_needs_a_reference_and_limits_must_apply(dose_model, tmp_path):
    path, _, markers = dose_model
    toml, _ = _dose_study(tmp_path, markers)
    refs = (tmp_path / "refs.csv").read_text().splitlines()
    (tmp_path / "refs.csv").write_text("\n".join(r for r in refs if not r.startswith("s5")))
    with pytest.raises(DataError, match=r"no reference result.*s5\.csv"):
        validate(path, toml)
    toml, _ = _dose_study(tmp_path, markers, "[acceptance]\nkappa = [0.8, 1.0]\n")
    with pytest.raises(ConfigError, match="kappa: the model gives values"):
        validate(path, toml)
    toml.write_text(toml.read_text().replace("kappa = [0.8, 1.0]", "bias = [1.0, -1.0]"))
    with pytest.raises(ConfigError, match="above high"):
        validate(path, toml)


def test_replicates_give_precision(dose_model, tmp_path):
    path, _, markers = dose_model
    toml, _ = _dose_study(tmp_path, markers, '[precision]\nreplicates = "reps.csv"\n')
    bags, _, _ = demo_samples("dose", 8, 11)
    # s0 measured again twice (the same cells, perturbed: another tube of the specimen).
    rng = np.random.default_rng(0)
    lines = ["file,specimen,run"] + [f"s{i}.csv,spec{i},r1" for i in range(9)]
    for k in (1, 2):
        name = f"s0-rep{k}.csv"
        _write_bag(tmp_path / name, bags[0] + rng.normal(0, 0.05, bags[0].shape), markers)
        lines.append(f"{name},spec0,r{k + 1}")
    refs = (tmp_path / "refs.csv").read_text().splitlines()
    dose0 = refs[1].split(",")[1]
    (tmp_path / "refs.csv").write_text(
        "\n".join([*refs, f"s0-rep1.csv,{dose0}", f"s0-rep2.csv,{dose0}"]) + "\n"
    )
    (tmp_path / "reps.csv").write_text("\n".join(lines) + "\n")
    doc = validate(path, toml)
    (row,) = doc["precision"]["rows"]
    values = [r["model"] for r in doc["per_sample"] if r["file"].startswith("s0")]
    assert row["specimen"] == "spec0" and row["n"] == 3 == len(values)
    # One replicate per run: the spread is all between runs, none within.
    assert row["n_runs"] == 3 and row["sd_repeatability"] is None


def test_validate_bag_classifier(tmp_path):
    from bagserve.core import DistributionRidgeClassifier

    bags, dose, markers = demo_samples("dose", 30, 4)
    level = np.where(dose > np.median(dose), "high", "low")
    model = DistributionRidgeClassifier(
        SlicedWasserstein(n_directions=20, n_levels=20, random_state=0), random_state=0
    ).fit(bags, level)
    path = save(
        model, tmp_path / "m", name="level", version="1", panel=Panel(tuple(markers)).to_json()
    )
    new, new_dose, _ = demo_samples("dose", 12, 5)
    truth = np.where(new_dose > np.median(dose), "high", "low")
    rows = ["file,level"]
    for i in range(len(new)):
        _write_bag(tmp_path / f"c{i:02d}.csv", new[i], markers)
        rows.append(f"c{i:02d}.csv,{truth[i]}")
    (tmp_path / "refs.csv").write_text("\n".join(rows) + "\n")
    toml = tmp_path / "validate.toml"
    toml.write_text(
        '[data]\nfiles = "c*.csv"\nlabels = "refs.csv"\nlabel_column = "level"\n'
        "[acceptance]\nsensitivity = [0.5, 1.0]\nkappa = [-1.0, 1.0]\n"
    )
    doc = validate(path, toml)
    served = predict_files(path, sorted(tmp_path.glob("c*.csv")))["results"]
    called = np.array([r["prediction"] for r in served])
    assert [r["model"] for r in doc["per_sample"]] == called.tolist()
    assert [r["agrees"] for r in doc["per_sample"]] == (called == truth).tolist()
    q = doc["qualitative"]["all"]
    assert q["n"] == 12 and doc["quantitative"] is None
    assert q["concordance"]["k"] == int(np.sum(called == truth))
    # Sensitivity judged for every class, on both sets; kappa once per set.
    assert len(doc["acceptance"]) == 2 * (2 + 1)
    toml.write_text(toml.read_text() + "slope = [0.9, 1.1]\n")
    with pytest.raises(ConfigError, match="slope: the model gives classes"):
        validate(path, toml)


def test_validate_per_cell_model(tmp_path):
    models = tmp_path / "models"
    build_demo_models(models)
    bags, labels, markers = demo_samples("gating", 3, 21)
    offsets = bags.offsets
    for i in range(len(bags)):
        _write_bag(tmp_path / f"p{i}.csv", bags[i], markers)
        # Gate numbers, named by the validation file's label_map.
        codes = np.argmax(labels[offsets[i] : offsets[i + 1], None] == POPULATIONS, axis=1)
        np.savetxt(tmp_path / f"gates{i}.txt", codes, fmt="%d")
    names = ", ".join(f'"{k}" = "{p}"' for k, p in enumerate(POPULATIONS.tolist()))
    toml = tmp_path / "validate.toml"
    toml.write_text(
        '[data]\nfiles = "p*.csv"\ncell_label_files = "gates{digits}.txt"\n'
        f"label_map = {{ {names} }}\n"
        "[acceptance]\nconcordance = [0.5, 1.0]\nbias = [-10.0, 10.0]\n"
        '[statistics]\ninterval = "exact"\n'
    )
    model = models / "demo-gating" / "1"
    doc = validate(model, toml)
    files = sorted(tmp_path.glob("p*.csv"))
    served = predict_files(model, files, cells=True)["results"]
    predicted = np.concatenate([np.asarray(r["labels"]) for r in served])
    q = doc["qualitative"]["all"]
    assert q["n"] == labels.size and q["interval"] == "exact"
    assert q["concordance"]["estimate"] == pytest.approx(np.mean(predicted == labels))
    classes = q["classes"]
    per_pop = {a["measurand"]: a for a in doc["quantitative"]["all"]}
    assert set(per_pop) == {f"{c} (% of cells)" for c in classes}
    first = [r for r in doc["per_sample"] if r["sample"] == "p0.csv"]
    cells0 = predicted[: len(bags[0])]
    for row in first:
        c = row["measurand"].removesuffix(" (% of cells)")
        assert row["model"] == pytest.approx(100 * np.mean(cells0 == c))
        assert row["reference"] == pytest.approx(100 * np.mean(labels[: len(bags[0])] == c))
        assert row["cell_concordance"] == pytest.approx(np.mean(cells0 == labels[: len(bags[0])]))
    # Per sample, its own cells' agreement.
    start = 0
    for i, one in enumerate(q["per_sample"]):
        n = len(bags[i])
        cells, truth = predicted[start : start + n], labels[start : start + n]
        assert one["sample"] == f"p{i}.csv" and one["n"] == n
        assert one["concordance"]["estimate"] == pytest.approx(np.mean(cells == truth))
        assert one["kappa"]["kappa"] == pytest.approx(cohen_kappa_score(truth, cells))
        start += n
    # Concordance on both sets, bias on every population and both sets.
    assert len(doc["acceptance"]) == 2 + 2 * len(classes)
    page = render_html(doc)
    assert "Qualitative comparison (CLSI EP12)" in page and "Confusion matrix" in page
    # Nothing declined: the page says the second set is the first, and judges it once.
    assert doc["samples"]["n_declined"] == 0 and "declined no sample" in page
    verdicts = re.findall(r'<td class="(pass|fail|unshown)">(PASS|FAIL|NOT SHOWN)</td>', page)
    assert [v[1] for v in verdicts] == [
        r["verdict"].upper() for r in doc["acceptance"] if r["set"] == "all"
    ]


def test_the_card_and_the_readme_state_the_intended_use():
    from bagserve.core.card import render_card

    root = Path(__file__).resolve().parents[1]
    stated = {"config": {"model": {"intended_use": "Dose of a yeast culture, research."}}}
    for metadata in ({}, stated):
        card = render_card(metadata, estimator="DistributionRidge", kind="regression")
        section = card.split("## Intended use", 1)[1].split("\n## ", 1)[0]
        assert "research use only, unless a laboratory validates" in section
        assert "`bagserve validate`" in section
    assert "Dose of a yeast culture, research." in card
    readme = (root / "README.md").read_text()
    assert "bagserve is for research use only, unless a laboratory validates" in readme
