"""Reading the files labs have (FCS, CSV/TSV, NPY), marker panels and preprocessing.

The package is split by what each module holds; everything public is importable from
here, as it was when this was one module:

* :mod:`.readers`: :func:`read_sample` reads one bag of cells with its marker names
  (FCS 2.0/3.0/3.1, CSV/TSV with a header row, optionally gzip-compressed, NPY);
  :func:`read_file` also returns the file's sha256.
* :mod:`.panel`: :class:`Panel` lists the markers a model takes, in order, with
  accepted aliases; :meth:`Panel.select` matches a sample's columns by name, case and
  punctuation insensitively (:func:`normalise_marker`), and names every missing or
  ambiguous marker.
* :mod:`.compensation`: :class:`Compensation` undoes fluorescence spillover with each
  FCS file's own matrix or one given in the training configuration.
* :mod:`.preprocessing`: :class:`Preprocessing` is the chain stored with a model:
  compensation, a per-marker transform (``arcsinh``, ``log``, ``logicle``,
  ``hyperlog``), per-marker standard scaling learned on the training cells, and a
  seeded subsample of huge bags that does not depend on cell order.
* :mod:`.fcs_writer`: :func:`fcs_with_channel` writes a sample back as FCS with one
  more channel (an explanation's contribution of each cell).
* :mod:`.labelled`: :func:`load_dataset` reads many files and their labels into a
  :class:`Dataset` with a fingerprint of both (:func:`dataset_fingerprint`).

Every reading problem raises :class:`DataError` (:mod:`core.errors`) naming the file,
and the row or column when there is one.
"""

from ..errors import DataError
from ..hashing import file_sha256
from .compensation import Compensation, Spillover, read_spillover_csv
from .fcs_writer import fcs_with_channel
from .labelled import Dataset, dataset_fingerprint, labelled_files, load_dataset, read_file_table
from .panel import Panel, normalise_marker
from .preprocessing import BagMoments, Preprocessing
from .preprocessing import Transform as Transform  # importable here as before the split
from .readers import SUPPORTED_SUFFIXES as SUPPORTED_SUFFIXES
from .readers import read_file, read_sample
from .sample import Sample

__all__ = [
    "BagMoments",
    "Compensation",
    "DataError",
    "Dataset",
    "Panel",
    "Preprocessing",
    "Sample",
    "Spillover",
    "dataset_fingerprint",
    "fcs_with_channel",
    "file_sha256",
    "labelled_files",
    "load_dataset",
    "normalise_marker",
    "read_file",
    "read_file_table",
    "read_sample",
    "read_spillover_csv",
]
