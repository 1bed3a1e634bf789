"""Memory of the marginal-transfer search: what its caches keep once fits reuse them."""

from __future__ import annotations

from bagserve.core import MarginalTransferClassifier
from bagserve.core.datasets import make_batched_cytometry_tasks
from bagserve.core.estimators._transfer_cv import _REUSED, reusing_fold_evaluations


def _caches() -> list[dict]:
    store = _REUSED.get()
    assert store is not None
    return [s["strategy"] for s in store.values() if isinstance(s, dict) and "strategy" in s]


def test_caches_kept_for_later_fits_keep_no_held_out_features():
    """The strategy's caches outlive the search (the training's fits reuse them), and
    they kept the held-out tasks' features of every bandwidth evaluated: 1.4 GB of the
    GvHD example's 2 GB. They are dropped once the search is over (the statistics
    stay); a fit reusing the evaluations chooses and predicts as a fit alone."""
    tasks, y, _ = make_batched_cytometry_tasks(1, 6, 1500, strength=2, random_state=0)
    with reusing_fold_evaluations():
        model = MarginalTransferClassifier(random_state=0).fit(tasks, y)
        caches = _caches()
        assert caches
        bandwidths = {k[1] for c in caches for k in c if k[0] == "statistics"}
        assert len(bandwidths) > 1  # the search did evaluate several
        for cache in caches:
            kept = [k[1] for k in cache if isinstance(k, tuple) and k[0] == "held-out features"]
            assert not kept, kept
        # A second fit in the block reuses the evaluations, its features computed again.
        reused = MarginalTransferClassifier(random_state=0).fit(tasks, y)
    again = MarginalTransferClassifier(random_state=0).fit(tasks, y)
    assert reused.selection_["best"] == again.selection_["best"]
    assert (reused.predict(tasks) == again.predict(tasks)).all()
    assert model.selection_["best"] == again.selection_["best"]
    assert (model.predict(tasks) == again.predict(tasks)).all()
