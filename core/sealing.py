"""Verified bytes that no file can change: memory a model is computed from.

A model is verified by hashing its files. A process that then maps or reads the files
again computes with whatever they hold by then: a byte changed in place changes its
answers under a hash that still names the release, and a file truncated under a map
kills the process at its next read of the lost pages (``SIGBUS``). So the bytes are
read once, hashed as they are read, and those very bytes are put in memory that
nothing can change afterwards, and computed with there:

* :class:`MemoryWriter` fills an anonymous memory file (Linux ``memfd``), then seals it
  (``F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``): from then on no
  process, its creator included, can change its bytes or its size
  (:class:`SealedMemory`). Other processes map it read-only from its descriptor
  (:meth:`SealedMemory.attach`, the descriptor passed over a socket), so that N
  processes share one copy. Where there is no ``memfd``, or nothing is shared, it
  fills memory of this process alone.
* :func:`npy_array` is an array over an NPY file's bytes in such memory: the header
  parsed as ``np.load`` parses it, object arrays refused (``allow_pickle=False``).
"""

from __future__ import annotations

import io
import math
import mmap
import os
import weakref

import numpy as np

__all__ = ["MemoryWriter", "SealedMemory", "npy_array", "shared_memory_available"]

#: Where the NPY format's header may end at the latest (numpy's own default limit of a
#: header's length, and the magic string, version and length before it).
_NPY_HEADER_MAX = 12 + 10_000


def shared_memory_available() -> bool:
    """Whether sealed memory files exist here (Linux): else memory is private."""
    return hasattr(os, "memfd_create") and hasattr(os, "MFD_ALLOW_SEALING")


def _seals() -> int:
    import fcntl

    return fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


#: The seals a shared memory file carries before anyone computes from it, in words.
_SEAL_NAMES = "write, shrink, grow, seal"


class MemoryWriter:
    """Memory being written, once, before it is read: :meth:`finish` turns it into
    :class:`SealedMemory`.

    Parameters
    ----------
    size : int
        Bytes.
    shared : bool
        An anonymous memory file (Linux ``memfd``), sealed by :meth:`finish`, that
        other processes can map; else memory of this process alone.
    """

    def __init__(self, size: int, *, shared: bool) -> None:
        self.size = size
        self._fd: int | None = None
        self._block: np.ndarray | None = None
        if shared:
            fd = os.memfd_create("bagserve-model", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(fd, size)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
        else:
            # Starting at a multiple of 64 bytes, as the NPY format's data does.
            raw = np.empty(size + 64, dtype=np.uint8)
            start = (-raw.ctypes.data) % 64
            self._block = raw[start : start + size]

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Put ``data`` at ``offset``."""
        if self._fd is None:
            assert self._block is not None
            self._block[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
            return
        view = memoryview(data).cast("B")
        while view:  # a memory file takes whole writes; a signal may cut one short
            n = os.pwrite(self._fd, view, offset)
            view, offset = view[n:], offset + n

    def finish(self, *, mapped: bool = True) -> SealedMemory:
        """The memory, read-only from now on: a memory file is sealed (``write,
        shrink, grow, seal``), then mapped here if ``mapped`` (a process that only
        hands it on leaves it unmapped). Private memory stays writable, as arrays
        read from files are."""
        if self._fd is None:
            assert self._block is not None
            block, self._block = self._block, None
            return SealedMemory(self.size, None, memoryview(block).cast("B"), block)
        import fcntl

        fd, self._fd = self._fd, None
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _seals())
            view, keep = _map_read_only(fd, self.size) if mapped else (None, None)
        except BaseException:
            os.close(fd)
            raise
        return SealedMemory(self.size, fd, view, keep)

    def discard(self) -> None:
        """Give the memory up unfinished."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._block = None


class SealedMemory:
    """Bytes written once, read-only afterwards (see the module docstring).

    Made by :meth:`MemoryWriter.finish`, or by :meth:`attach` in another process.

    Attributes
    ----------
    size : int
        Bytes.
    fd : int or None
        The sealed memory file (shared memory), open until this object goes; None for
        private memory or once :meth:`close` ran.
    view : memoryview or None
        The bytes (read-only when shared); None where they are not mapped here.
    """

    def __init__(
        self, size: int, fd: int | None, view: memoryview | None, keep: object = None
    ) -> None:
        self.size = size
        self.fd = fd
        self.view = view
        self._keep = keep  # what owns the view's memory (a map, an array)
        self._close_fd = weakref.finalize(self, os.close, fd) if fd is not None else None

    @classmethod
    def attach(cls, fd: int, size: int) -> SealedMemory:
        """Map another process's sealed memory file read-only; takes ``fd`` over (it is
        closed here, whatever happens).

        Raises
        ------
        ValueError
            The file is not sealed against writes and resizing, or not ``size`` bytes.
        """
        import fcntl

        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if seals & _seals() != _seals():
                raise ValueError(f"the shared model memory is not sealed ({_SEAL_NAMES})")
            if os.fstat(fd).st_size != size:
                raise ValueError("the shared model memory is not of the size announced")
            # Populated up front: the pages are in memory already, so this only sets
            # up the page tables (no fault at the first request).
            view, keep = _map_read_only(fd, size, populate=True)
        finally:
            os.close(fd)
        return cls(size, None, view, keep)

    def close(self) -> None:
        """Close the memory file's descriptor now (also done when this object goes)."""
        if self._close_fd is not None:
            self._close_fd()
        self.fd = None


def _map_read_only(fd: int, size: int, populate: bool = False) -> tuple[memoryview, object]:
    if not size:
        return memoryview(b"").cast("B"), None
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    mapping = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    return memoryview(mapping), mapping


def npy_array(data: memoryview) -> np.ndarray:
    """The array an NPY file's bytes hold, over those bytes (no copy).

    Read as ``np.load(..., allow_pickle=False)`` reads a file: format versions 1.0
    and 2.0, C or Fortran order, no object arrays. The array is read-only where the
    bytes are.

    Raises
    ------
    ValueError
        Not an NPY file, a header numpy would not read, an object array, or fewer
        bytes than the header promises.
    """
    fp = io.BytesIO(bytes(data[:_NPY_HEADER_MAX]))
    fmt = np.lib.format
    version = fmt.read_magic(fp)
    if version == (1, 0):
        shape, fortran, dtype = fmt.read_array_header_1_0(fp)
    elif version == (2, 0):
        shape, fortran, dtype = fmt.read_array_header_2_0(fp)
    else:
        raise ValueError(f"NPY format version {version[0]}.{version[1]} is not read")
    if dtype.hasobject:
        raise ValueError("object arrays cannot be loaded without pickle")
    offset = fp.tell()
    count = math.prod(shape)
    if count * dtype.itemsize > len(data) - offset:
        raise ValueError(
            f"{len(data) - offset} bytes of data where the header declares {shape} {dtype}"
        )
    array = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    return array.reshape(shape, order="F" if fortran else "C")
