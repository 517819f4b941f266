"""Crash-safe replacement of a folder (checkpoints, MTP heads, training state): whatever instant a
save is killed at, the next reader finds the newest complete copy.

A save of DEST runs these steps; each rename is atomic on a POSIX file system:
  1. write     the files into a private sibling .DEST.tmp-PID-XXXXXX, fsync them and the folder
  2. ready     rename it to .DEST.new    (a complete copy now exists under a known name)
  3. retire    rename DEST to .DEST.old  (when DEST exists)
  4. promote   rename .DEST.new to DEST
  5. drop      delete .DEST.old
`recover(DEST)`, run before every save and every read of resume state, finishes an interrupted
sequence: a .DEST.new is complete and newer than anything else, so it is promoted; without one,
a lone .DEST.old (DEST gone) is put back. Then the leftovers of killed saves (.DEST.old beside a
DEST, .DEST.tmp-* folders) are deleted.

Any number of writers, in processes or threads: a save and a recovery hold DEST's lock (`exclusive`,
an flock on .DEST.lock beside it) from step 1 to step 5, so a leftover seen under the lock belongs
to a writer that died, never to one at work; the others wait. The kernel releases the lock of a
process that dies, and the holder deletes the lock file when it lets go.

A save that fails (full disk, no permission) leaves DEST as it was and raises SpecdecError saying
so. Folders and files get the permissions the umask allows, as `mkdir` and `open` give them.

This module knows nothing about what the folders hold.
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import shutil
import sys
import threading
from contextlib import ExitStack, contextmanager
from pathlib import Path

from safetensors import SafetensorError

from ..errors import SpecdecError

FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
DENIED = {errno.EACCES, errno.EPERM, errno.EROFS}
_HELD = threading.local()  # .paths: the locks this thread holds (exclusive is reentrant)


def _new_old(dest: Path) -> tuple[Path, Path]:
    return dest.with_name(f".{dest.name}.new"), dest.with_name(f".{dest.name}.old")


def _leftovers(dest: Path) -> list[Path]:
    # .DEST.tmp-*: killed writes; .DEST.XXXXXXXX: the tempfile names of specdec before 0.2
    pattern = re.compile(rf"\.{re.escape(dest.name)}\.(tmp-.+|[a-z0-9_]{{8}})")
    found = [p for p in dest.parent.glob(".*") if pattern.fullmatch(p.name)]
    old = _new_old(dest)[1]
    return found + ([old] if dest.exists() and old.exists() else [])


def _lock_file(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.lock")


@contextmanager
def exclusive(dest: str | Path, waiting: str | None = None):
    """Hold the lock of `dest` (reentrant in a thread); `waiting`, printed when another holds it."""
    dest = Path(dest).absolute()
    held = _HELD.__dict__.setdefault("paths", set())
    if dest in held:
        yield
        return
    lock = _lock_file(dest)
    while True:
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o666)
        except OSError as e:
            raise write_error(dest, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                print(waiting, file=sys.stderr, flush=True)
                waiting = None
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        try:  # the lock counts only if its file is still the one at the path (its last holder deletes it)
            current = os.stat(lock)
        except FileNotFoundError:  # deleted by the holder we waited for
            current = None
        mine = os.fstat(fd)
        if current is not None and (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
            break
        os.close(fd)
    held.add(dest)
    try:
        yield
    finally:
        held.discard(dest)
        lock.unlink(missing_ok=True)  # before letting go: a waiter then sees another file and opens anew
        os.close(fd)


def _pending(dest: Path) -> bool:
    """Whether beside `dest` lies anything a recovery deals with (or a lock: a writer at work, or dead)."""
    return any(p.exists() for p in (*_new_old(dest), _lock_file(dest))) or bool(_leftovers(dest))


def recover(dest: str | Path) -> None:
    """Finish a save of `dest` that was interrupted, and delete what killed saves left behind
    (waiting for a save under way to end)."""
    dest = Path(dest)
    if not _pending(dest):  # the usual case takes no lock: reading a read-only folder stays possible
        return
    with exclusive(dest):
        _recover(dest)


def _recover(dest: Path) -> None:
    new, old = _new_old(dest)
    if new.is_dir():
        if dest.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(dest, old)
        os.replace(new, dest)
    elif old.is_dir() and not dest.exists():
        os.replace(old, dest)
    for path in _leftovers(dest):
        shutil.rmtree(path, ignore_errors=True)


def umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    current = os.umask(0o022)  # no /proc: read it the only portable way, and put it back at once
    os.umask(current)
    return current


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _finish_files(folder: Path) -> None:
    """Durable files with the permissions a plain `open` gives (some writers use 0600)."""
    mode = 0o666 & ~umask()
    for f in folder.iterdir():
        if f.is_file():
            os.chmod(f, mode)
            _fsync(f)
    _fsync(folder)


def write_error(dest: Path, e: BaseException) -> SpecdecError:
    code = getattr(e, "errno", None)
    text = str(e)
    if code in FULL or "No space left" in text or "StorageFull" in text or "too large" in text:
        why, todo = "the disk is full (or a file-size limit or quota was reached)", "free some space or write elsewhere"
    elif code in DENIED or "ermission denied" in text:
        why, todo = "permission denied", "choose a folder you may write to (e.g. another --out) or fix its permissions"
    else:
        why, todo = "the write failed", "check the folder and the disk"
    return SpecdecError(f"cannot save {dest}: {why} ({type(e).__name__}: {text}); {todo}. Nothing was "
                        f"replaced: the previous {dest.name} (if any) is intact")


@contextmanager
def atomic_dir(dest: str | Path):
    """Yield a private folder to write into; it replaces `dest` only when the block succeeds."""
    dest = Path(dest)
    with ExitStack() as held:
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            held.enter_context(exclusive(dest))  # from the recovery until the new copy is in place (or SpecdecError)
            _recover(dest)
            tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}")
            tmp.mkdir()
        except OSError as e:
            raise write_error(dest, e) from None
        try:
            yield tmp
            _finish_files(tmp)
            new, old = _new_old(dest)
            os.replace(tmp, new)                  # ready
            if dest.exists():
                os.replace(dest, old)             # retire
            os.replace(new, dest)                 # promote
            _fsync(dest.parent)
            shutil.rmtree(old, ignore_errors=True)  # drop
        except (OSError, SafetensorError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise write_error(dest, e) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
