"""Atomic, durable file and directory writes: a reader (or a process killed with -9 half way) never sees a
partly written file or directory under its final name.

Every write goes to a temporary name in the same directory (same file system, so the final rename is atomic),
is flushed to disk with fsync, and is then renamed into place; the parent directory is fsynced so the rename
itself survives a power loss. Temporary names start with ".tmp-" so listings can skip them.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

TEMP_PREFIX = ".tmp-"


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# tempfile creates private files (0600) and directories (0700); finished files get the permissions an ordinary
# write would give them, so a bundle can be shared. Read once, at import: os.umask is process-wide and racy.
_UMASK = _current_umask()
FILE_MODE = 0o666 & ~_UMASK
DIR_MODE = 0o777 & ~_UMASK


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the directory's entries (created or renamed files) durable."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # platforms that cannot open directories (Windows) have no directory fsync either
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems (e.g. certain network mounts) refuse fsync on directories
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def atomic_write_with(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call `write(temp_path)` to produce the file, then move it onto `path` atomically.

    For writers that want a file name rather than a file object (e.g. safetensors.torch.save_file).
    """
    path = Path(path)
    fd, temp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{path.name}-", dir=path.parent)
    os.close(fd)
    try:
        write(Path(temp))
        os.chmod(temp, FILE_MODE)
        fsync_file(temp)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` so that `path` holds either its old content or all of `data`, never a mix."""

    def write(temp: Path) -> None:
        with open(temp, "wb") as f:
            f.write(data)

    return atomic_write_with(path, write)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def json_bytes(obj: Any) -> bytes:
    """The one JSON formatting nanscan writes: stable key order as given, two-space indent, final newline.

    Strict JSON (no NaN/Infinity tokens), so files stay readable by any JSON parser; callers encode
    non-finite floats themselves.
    """
    return (json.dumps(obj, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_bytes(path, json_bytes(obj))


def write_results_json(path: str | os.PathLike, results: Any) -> Path:
    """A benchmark's results file: atomic_write_json, creating its directory first."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_json(path, results)


def sha256_file(path: str | os.PathLike, *, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def is_temp_name(name: str) -> bool:
    return name.startswith(TEMP_PREFIX)


def _writer_tag() -> str:
    """Who writes a temporary directory: `<pid>@<host>`, so a later write can tell a dead writer's leftovers."""
    return f"{os.getpid()}@{socket.gethostname()}"


def _process_is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive but someone else's (EPERM), or a platform without signal 0
        return False
    return False


def remove_dead_writers_temps(final: Path) -> list[Path]:
    """Remove the temporary directories that writes of `final` left when their process died (kill -9, a crash).

    NOTE: [dead writers]
    A temporary directory is named `.tmp-<name>-<pid>@<host>-XXXX` (atomic_directory). Only those of writers on
    this host whose process no longer exists are removed: a live writer's directory (another rank, another
    process writing the same bundle) is never touched, and neither is one from another host sharing the file
    system, where a process id says nothing. A reused pid keeps a leftover alive, which is the safe side.
    Returns what was removed."""
    prefix, host = f"{TEMP_PREFIX}{final.name}-", socket.gethostname()
    removed = []
    try:
        entries = list(final.parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix) or not entry.is_dir():
            continue
        tag = entry.name[len(prefix):].rsplit("-", 1)[0]  # mkdtemp's random suffix has no '-'
        pid, _, where = tag.partition("@")
        if where == host and pid.isdigit() and _process_is_gone(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _swap_in(temp: Path, final: Path) -> None:
    """Put the directory `temp` at `final`, replacing the directory there: the old one is parked under a dead
    writer's name (NOTE: [dead writers]: removed later if this process dies before it does), then removed. A
    reader sees the old directory, none for an instant, or the new one; never a mix."""
    parked = final.with_name(f"{TEMP_PREFIX}{final.name}-{_writer_tag()}-old{secrets.token_hex(4)}")
    os.rename(final, parked)
    try:
        os.rename(temp, final)
    except BaseException:
        os.rename(parked, final)
        raise
    shutil.rmtree(parked, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike, *, replace: bool = False) -> Iterator[Path]:
    """Build a directory under a temporary name and rename it to `final` when the block succeeds.

    The temporary directory sits beside `final` (`.tmp-<name>-<pid>@<host>-XXXX`). If the block raises, it is
    removed; if the process dies, it stays behind under its temporary name, which readers ignore, until the next
    write of `final` on the same host removes it (NOTE: [dead writers]). If `final` already exists and is not
    empty when the block ends (another process got there first), the temporary directory is removed and
    FileExistsError is raised: the caller decides whether the existing one is acceptable. With `replace`, an
    existing `final` is swapped out instead (_swap_in).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_writers_temps(final)
    temp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{final.name}-{_writer_tag()}-", dir=final.parent))
    try:
        os.chmod(temp, DIR_MODE)
        yield temp
        for root, _dirs, files in os.walk(temp):
            for name in files:
                fsync_file(os.path.join(root, name))
            fsync_dir(root)
        try:
            if replace and final.exists():
                _swap_in(temp, final)
            else:
                os.rename(temp, final)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise FileExistsError(errno.EEXIST, f"{final} already exists", str(final)) from None
            raise
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    fsync_dir(final.parent)
