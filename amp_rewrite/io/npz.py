"""Read an .npz (sample inputs, training checkpoints) without trusting it: one line per fault.

Sizes come from the zip directory and each .npy header before anything is inflated or allocated
(a zip bomb is refused, not inflated); each member is read to its end, so its CRC is checked; an
object array is refused (nothing is unpickled); a header whose shape and dtype ask for other than
the bytes present is refused. numpy's own `np.load` inflates first and raises several kinds of
exception for these; callers get their own error class instead.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from io import BytesIO
from pathlib import Path

import numpy as np

from amp_rewrite.errors import UsageError
from amp_rewrite.io.external import open_regular, shown

MAX_HEADER = 10_000  # numpy's own default limit on a .npy header
CHUNK = 2**24
_METHODS = {zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA}


def memory_limit() -> int:
    """Half the machine's memory: more than that cannot be meant as samples or a checkpoint."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (AttributeError, OSError, ValueError):
        return 8 * 2**30


def read_npz(path, *, what: str, error=UsageError, limit: int | None = None) -> dict[str, np.ndarray]:
    """{key: array} of the .npz at `path` (keys without '.npy'), checked as the module says.

    `what` starts each error line (e.g. "--inputs samples.npz"); `error` is its class; `limit`
    caps the bytes of all arrays together (default: half the machine's memory)."""
    limit = memory_limit() if limit is None else limit
    with open_regular(Path(path), what=what, error=error) as handle:
        try:
            with zipfile.ZipFile(handle) as archive:
                infos = archive.infolist()
                _check_directory(infos, limit, what, error)
                return {info.filename[:-4]: _read_member(archive, info, what, error) for info in infos}
        except (
            zipfile.BadZipFile,
            zlib.error,
            EOFError,
            OSError,
            NotImplementedError,
            RuntimeError,
            ValueError,
        ) as exc:
            raise error(
                f"{what}: not a readable .npz ({' '.join(str(exc).split())[:200] or type(exc).__name__})"
            ) from None
        except MemoryError:
            raise error(f"{what}: too large to read") from None


def _check_directory(infos, limit: int, what: str, error) -> None:
    """What the zip's directory says, checked before a byte is inflated."""
    names = set()
    total = 0
    for info in infos:
        name = info.filename
        if not name.endswith(".npy") or info.is_dir():
            raise error(f"{what}: member {shown(name)} is not a .npy array")
        if name in names:
            raise error(f"{what}: member {shown(name)} appears twice")
        names.add(name)
        if info.flag_bits & 0x1:
            raise error(f"{what}: member {shown(name)} is encrypted")
        if info.compress_type not in _METHODS:
            raise error(
                f"{what}: member {shown(name)} uses an unsupported compression ({info.compress_type})"
            )
        total += info.file_size
        if total > limit:
            raise error(
                f"{what}: its arrays would take more than {limit} bytes (the zip directory says "
                f"{total} so far); not inflated"
            )


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, what: str, error) -> np.ndarray:
    """One member read whole into a buffer of its declared size (its CRC checked at the end)."""
    name = shown(info.filename)
    buffer = bytearray(info.file_size)
    view = memoryview(buffer)
    done = 0
    with archive.open(info) as member:
        while done < info.file_size:
            chunk = member.read(min(CHUNK, info.file_size - done))
            if not chunk:
                raise error(f"{what}: member {name} is shorter than the zip directory says")
            view[done : done + len(chunk)] = chunk
            done += len(chunk)
        if member.read(1):
            raise error(f"{what}: member {name} is longer than the zip directory says")
    return _parse_npy(buffer, name, what, error)


def _parse_npy(buffer: bytearray, name: str, what: str, error) -> np.ndarray:
    """The array in a .npy image, its header checked before the data is looked at."""
    fp = BytesIO(buffer)
    try:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp, max_header_size=MAX_HEADER)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp, max_header_size=MAX_HEADER)
        else:
            raise error(f"{what}: member {name} is a .npy of version {version}, not 1.0 or 2.0")
    except (ValueError, TypeError, SyntaxError, EOFError) as exc:
        raise error(
            f"{what}: member {name} is not a valid .npy array ({' '.join(str(exc).split())[:160]})"
        ) from None
    if dtype.hasobject:
        raise error(f"{what}: member {name} is an object array (not loaded: reading it would unpickle)")
    count = 1
    for dim in shape:
        count *= dim
    need, have = count * dtype.itemsize, len(buffer) - fp.tell()
    if need != have:
        raise error(
            f"{what}: member {name} holds {have} bytes of data but its shape {list(shape)} of "
            f"{dtype} needs {need}"
        )
    array = np.frombuffer(buffer, dtype=dtype, count=count, offset=fp.tell())
    return array.reshape(shape, order="F" if fortran else "C")
