"""Where a run writes: the output plan (checked before any work) and the output pair (replaced whole).

`OutputPlan` holds every path a run will write (model, report, HTML) and compares them, by
resolved identity (`os.path.samefile` where both exist), with each other and with every path the
run reads (the model and each of its external-data files): a clash is one OutputError line, and an
existing output needs `force`. `OutputPair` writes a model and its external data so that a reader
never sees one run's model with another run's data: the data goes under a name unique to the run,
the model that names it is renamed into place last, and the data files of the model it replaced
are removed after. Concurrent runs writing one output take turns for those renames and removals
(an advisory lock on the folder, milliseconds), so each removes exactly the data of the model it
replaced, and the orphan of a run killed between its two renames is removed by the next. Nothing
it made outlives an error or an interrupt (temporaries are removed on the way out; the CLI turns
SIGTERM into such an interrupt); a SIGKILL may leave a hidden `.NAME.*.tmp`, which no run reads.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

import onnx

from amp_rewrite.errors import OutputError
from amp_rewrite.io import external

OLD_MODEL_PARSE_LIMIT = (
    64 * 2**20
)  # a model file with external data is small; a bigger one names none of ours


def _same(a: Path, b: Path) -> bool:
    """Whether two paths name one file: by identity where both exist, else by resolved path."""
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
        return os.path.realpath(a) == os.path.realpath(b)
    except (OSError, ValueError):
        return False


class OutputPlan:
    """Every path a run writes ({flag: path}), checked against each other and every path it reads."""

    def __init__(self, writes: dict, *, reads: Iterable = (), force: bool = False):
        self.writes = {flag: Path(path) for flag, path in writes.items() if path is not None}
        self.force = force
        self.reads: list[Path] = []
        self.check_reads(reads)  # clashes first: --force never makes one right
        items = list(self.writes.items())
        for i, (flag, path) in enumerate(items):
            for other_flag, other in items[:i]:
                if _same(path, other):
                    raise OutputError(f"{path}: {other_flag} and {flag} name the same file; choose another")
        for flag, path in items:
            self._check_writable(flag, path)

    def _check_writable(self, flag: str, path: Path) -> None:
        try:
            exists = path.exists() or path.is_symlink()
            is_dir = path.is_dir()
            special = exists and path.exists() and not path.is_file()
        except (OSError, ValueError) as exc:
            raise OutputError(
                f"{path}: {flag} cannot be written ({getattr(exc, 'strerror', None) or exc})"
            ) from None
        if is_dir:
            raise OutputError(f"{path}: is a directory")
        if special:  # a device, a FIFO, a socket: never replaced, even with --force
            raise OutputError(f"{path}: is not a regular file; choose another path")
        if exists and not self.force:
            raise OutputError(f"{path}: already exists (use --force to replace it)")
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise OutputError(f"{path}: folder {parent} does not exist")
        if not os.access(parent, os.W_OK):
            raise OutputError(f"{path}: folder {parent} is not writable")

    def check_reads(self, reads: Iterable, *, label: str | None = None) -> None:
        """Refuse a write onto a file the run reads (the first read is the input model, the rest its
        data files), whatever `force` says."""
        for source in reads:
            if source is None:
                continue
            source = Path(source)
            what = label or ("the input model" if not self.reads else "a data file of the input model")
            for flag, path in self.writes.items():
                if _same(path, source):
                    raise OutputError(f"{path}: {flag} is {what}; choose another path")
            self.reads.append(source)


def _file_mode() -> int:
    """The mode a plainly created file gets (0666 less the umask); mkstemp's is 0600."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def interrupt_hook(stage: str) -> None:
    """Test hook: AMP_REWRITE_TEST_PAUSE=stage:seconds sleeps at that point of a run ("load": the
    model file read; "rename", "between": a write's two renames); stage:@FILE waits there (a
    minute at most) until FILE exists, having made FILE.reached."""
    spec = os.environ.get("AMP_REWRITE_TEST_PAUSE", "")
    if not spec.startswith(stage + ":"):
        return
    value = spec.split(":", 1)[1]
    if not value.startswith("@"):
        time.sleep(float(value))
        return
    Path(value[1:] + ".reached").touch()  # the test knows this process is here
    deadline = time.monotonic() + 60
    while not os.path.exists(value[1:]) and time.monotonic() < deadline:
        time.sleep(0.02)


def remove_quietly(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_tmp(path: Path, write: Callable[[BinaryIO], object]) -> str:
    """`write` into a hidden temporary file beside `path`, fsync'd; its name (removed on failure)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, _file_mode())
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        remove_quietly(tmp)
        raise
    return tmp


def _sync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _ours(path: Path, name: str) -> bool:
    """A data file name this module gives the output `path`: `<name>.data` or `<name>.<run>.data`."""
    return name == f"{path.name}.data" or _run_named(path, name)


def _run_named(path: Path, name: str) -> bool:
    """`<name>.<run>.data`: the name `OutputPair` gives one run's data, and only it."""
    return re.fullmatch(re.escape(path.name) + r"\.[0-9a-f]{8}\.data", name) is not None


def old_data_files(path: Path) -> list[Path]:
    """The data files the model now at `path` names that are ours to replace (in its folder, named
    as `OutputPair` names them); nothing for a file that is not a small model."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > OLD_MODEL_PARSE_LIMIT:
            return []
        old = onnx.ModelProto()
        old.ParseFromString(external.read_bounded(path, OLD_MODEL_PARSE_LIMIT, what="old output"))
        names = {
            e.value
            for t in external.model_tensors(old)
            if external.is_external(t)
            for e in t.external_data
            if e.key == "location"
        }
    except Exception:  # not a model, unreadable: it names nothing we would remove
        return []
    return [path.parent / n for n in sorted(names) if "/" not in n and os.sep not in n and _ours(path, n)]


def orphan_data_files(path: Path, named: list[Path]) -> list[Path]:
    """Run-unique data files of the output `path` that the model now there does not name: left by a
    run killed between placing its data and renaming its model (SIGKILL, power loss). Called with
    the folder's lock held, when no other run can be between those two steps. `named`: the data
    files the model names."""
    named = {p.name for p in named}
    try:
        names = os.listdir(path.parent or ".")
    except OSError:
        return []
    return [path.parent / n for n in sorted(names) if _run_named(path, n) and n not in named]


@contextlib.contextmanager
def _folder_lock(folder: Path):
    """An exclusive advisory lock on the output's folder for one run's renames and removals, so
    that concurrent runs writing one output take turns: each removes exactly the data of the model
    it replaced, and none removes what the current model names. Held for milliseconds (the data
    was written before); released by the kernel if the process dies. No lock where the platform
    or file system has none (the renames are still atomic; only a stale file may be left). Yields
    whether the lock is held: orphans may be removed only then."""
    try:
        import fcntl

        fd = os.open(folder if str(folder) else ".", os.O_RDONLY)
    except (ImportError, OSError):
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            locked = True
        except OSError:
            locked = False
        yield locked
    finally:
        os.close(fd)  # closing releases the lock


def _place(tmp: str, target: Path) -> None:
    """Give the finished temporary its run-unique name, never over an existing file: a hard link
    where the file system has them, else a rename after checking the name is free."""
    try:
        os.link(tmp, target)
        return
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in (
            errno.EPERM,
            errno.ENOTSUP,
            errno.EOPNOTSUPP,
            errno.ENOSYS,
            errno.EXDEV,
            errno.EMLINK,
        ):
            raise
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
    os.rename(tmp, target)


class OutputPair:
    """A model file and its external-data file, replaced together (see the module docstring).

        with OutputPair(path, keep=plan.reads) as pair:
            pair.write_data(lambda handle: ...)  # optional: streams the data (refer to pair.data_name)
            pair.commit(lambda handle: handle.write(model_bytes))

    `keep`: files never removed (the run's inputs), even when the replaced model named them.
    """

    def __init__(self, path, *, keep: Iterable = (), data_name: str | None = None):
        self.path = Path(path)
        # a name the caller chose (--external-data NAME) replaces that file, after the output plan
        # allowed it: a reader between the two renames may then see the new data with the old model
        self.fixed_name = data_name is not None
        self.data_name = data_name or f"{self.path.name}.{secrets.token_hex(4)}.data"
        self.data_path = self.path.parent / self.data_name
        self.keep = [Path(k) for k in keep]
        self._data_tmp: str | None = None
        self._linked = False
        self._committed = False

    def __enter__(self) -> OutputPair:
        return self

    def __exit__(self, *exc) -> None:
        self.abort()

    def write_data(self, write: Callable[[BinaryIO], object]) -> None:
        """Stream the data file into a hidden temporary beside the model (fsync'd)."""
        self._data_tmp = write_tmp(self.path, write)

    @property
    def has_data(self) -> bool:
        return self._data_tmp is not None or self._linked

    @property
    def data_file(self) -> Path:
        """Where the data written so far is now (its temporary, or its place once committed)."""
        return Path(self._data_tmp) if self._data_tmp is not None else self.data_path

    def drop_data(self) -> None:
        """Forget the data written (nothing went into it): the model is one plain file."""
        if self._data_tmp is not None:
            remove_quietly(self._data_tmp)
            self._data_tmp = None

    def commit(self, write_model: Callable[[BinaryIO], object]) -> None:
        """Write the model, then, holding the folder's lock, put the data then the model in place
        and remove the replaced model's data and any orphan of a killed run."""
        model_tmp = write_tmp(self.path, write_model)
        with _folder_lock(self.path.parent) as locked:
            self._replace(model_tmp, locked)

    def _replace(self, model_tmp: str, locked: bool) -> None:
        try:
            old = old_data_files(self.path)
            if locked:  # without the lock another run may be between its renames: its data is not an orphan
                old += orphan_data_files(self.path, old)
            interrupt_hook("rename")
            if self._data_tmp is not None:
                if self.fixed_name:
                    os.replace(self._data_tmp, self.data_path)
                else:
                    _place(self._data_tmp, self.data_path)
                self._linked = True
                remove_quietly(self._data_tmp)
                self._data_tmp = None
            interrupt_hook("between")
            os.replace(model_tmp, self.path)
            model_tmp = None
            self._committed = True
            _sync_folder(self.path.parent)
        finally:
            if model_tmp is not None:
                remove_quietly(model_tmp)
        for stale in old:
            if stale.name != self.data_name and not any(_same(stale, k) for k in self.keep):
                remove_quietly(stale)

    def abort(self) -> None:
        """Remove whatever this pair made that is not committed (safe to call twice)."""
        if self._data_tmp is not None:
            remove_quietly(self._data_tmp)
            self._data_tmp = None
        if self._linked and not self._committed:
            remove_quietly(self.data_path)
            self._linked = False
