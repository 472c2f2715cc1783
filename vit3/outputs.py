"""How vit3 writes what it makes, so that no result is ever destroyed: atomic writes and folder locks.

* :func:`atomic_path` (and :func:`atomic_write`, :func:`write_text`, :func:`write_bytes`): every file vit3
  writes goes to a temporary name in its own folder (``.<name>.tmp<pid><suffix>``), is flushed to disk
  (``fsync``) and moved into place with ``os.replace``. A killed process or a full disk leaves the file
  already there as it was, never a truncated one; the next write of that file removes the temporary file of a
  writer that died.
* :func:`hold_folder`: the lock on a run's folder for the run's whole life (``.vit3.lock``: an exclusive
  ``flock``, which the system releases when the holder dies, kill -9 included). A second command into a folder
  that a live one holds is refused, naming the folder and the holder's process id; the lock a dead process
  left is taken over.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from .errors import OUTPUT_ERRNOS, ConfigError, OutputError, Terminated, raise_terminated

try:
    import fcntl
except ImportError:  # no flock (Windows): the lock file's process id alone says whether it is held
    fcntl = None

LOCK_FILE = ".vit3.lock"

# The checkpoints a run writes in its output folder, and every file and folder of its own there (moved aside
# with them by train.overwrite): records, plots, and what eval.py wrote beside the checkpoints.
CHECKPOINT_FILES = ("last.pt", "best.pt")
RESULT_FILES = ("summary.json", "metrics.csv", "metrics.json", "curves.png", "samples")
RUN_FILES = (*CHECKPOINT_FILES, "config.yaml", *RESULT_FILES)
RUN_PATTERNS = ("*.eval.json", "samples_*")

__all__ = [
    "CHECKPOINT_FILES",
    "LOCK_FILE",
    "RESULT_FILES",
    "RUN_FILES",
    "RUN_PATTERNS",
    "atomic_path",
    "atomic_write",
    "hold_folder",
    "interrupts_deferred",
    "lock_holder",
    "write_bytes",
    "write_text",
]


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (one of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process (or no such process id)
        return False
    except OSError:  # e.g. PermissionError: it exists
        return True
    return True


_TEMP_NAME = re.compile(r"\..+\.tmp(\d+)(\.[^.]*)?")


def _remove_stale_temp_files(path: Path) -> None:
    """Removes the temporary files of ``path`` (``.<name>.tmp<pid>[.suffix]``) that writers which died (a
    killed run) left behind; those of live processes stay."""
    literal = re.sub(r"([*?[])", r"[\1]", path.name)  # glob characters in the name matched as themselves
    for stale in path.parent.glob(f".{literal}.tmp*"):
        match = _TEMP_NAME.fullmatch(stale.name)
        if match and not _pid_alive(int(match.group(1))):
            with contextlib.suppress(OSError):
                stale.unlink()


def _fsync_dir(folder: Path) -> None:
    """Makes a rename inside ``folder`` durable (POSIX; a no-op where directories cannot be opened)."""
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


@contextlib.contextmanager
def atomic_path(
    path: str | Path, what: str = "file", durable: bool = True, clean: bool = True
) -> Iterator[Path]:
    """A temporary path beside ``path`` for the body to write (``.<name>.tmp<pid><suffix>``: the same suffix,
    for writers that read the format from it), moved to ``path`` when the body ends without an error and
    removed otherwise.

    Args:
        path: the file to write (its folder is created).
        what: what the file is, for messages ("checkpoint", "report", ...).
        durable: ``fsync`` the file before the rename and the folder after it (off for many small files, e.g.
            one per image: a kill or a full disk still never leaves a partial file, a power cut may).
        clean: first remove the temporary files of ``path`` that dead writers left (a scan of the folder).

    Raises:
        OutputError: the system refused the write (no permission, a full disk, a path under a file): the
            message names the file and the reason; a file already at ``path`` is left as it was.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}{path.suffix}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if clean:
            _remove_stale_temp_files(path)
        yield tmp
        if durable:  # the data is on disk before the rename makes it the file
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
        if durable:
            _fsync_dir(path.parent)
    except OSError as e:
        if e.errno not in OUTPUT_ERRNOS or isinstance(e, OutputError):
            raise
        kept = f"the {what} already there is left as it was" if path.is_file() else "nothing was written"
        raise OutputError(f"cannot write {what} {path}: {e.strerror or e} ({kept})") from e
    finally:
        with contextlib.suppress(OSError):  # a folder that refused the file may refuse its removal too
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Holds back Ctrl-C (SIGINT), and SIGTERM where a script takes it as Ctrl-C
    (``errors.raise_terminated``), for the body, then raises the ``KeyboardInterrupt`` (``Terminated``) it
    held, if any.

    A write that Ctrl-C cuts short leaves what wrote it half done: ``torch.save``'s zip writer, cut, later
    finishes its archive into the file closed under it, and the process aborts at exit. Held back, the write
    completes first. Only the main thread receives signals; elsewhere the body runs as it is.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield  # no signal here, or a handler set outside Python, which could not be put back
        return
    held: list[int] = []
    signals = [signal.SIGINT]
    if signal.getsignal(signal.SIGTERM) is raise_terminated:  # run_cli's: SIGTERM taken as Ctrl-C
        signals.append(signal.SIGTERM)
    before = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in signals}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    if held:
        raise Terminated if held[0] == signal.SIGTERM else KeyboardInterrupt


@contextlib.contextmanager
def atomic_write(
    path: str | Path,
    what: str = "file",
    text: bool = False,
    durable: bool = True,
    clean: bool = True,
    newline: str | None = None,
) -> Iterator[IO[Any]]:
    """:func:`atomic_path` with the temporary file open for the body: binary, or UTF-8 text with ``text``
    (``newline`` as :func:`open`'s); the other arguments are :func:`atomic_path`'s. Ctrl-C waits for the
    write (:func:`interrupts_deferred`).

    Raises:
        OutputError: the system refused the write (see :func:`atomic_path`).
    """
    with interrupts_deferred(), atomic_path(path, what, durable, clean) as tmp:
        mode = {"mode": "w", "encoding": "utf-8", "newline": newline} if text else {"mode": "wb"}
        with open(tmp, **mode) as f:
            yield f


def write_text(path: str | Path, text: str, what: str = "file", durable: bool = True) -> Path:
    """Writes ``text`` (UTF-8) to ``path`` with :func:`atomic_write`; returns ``path``."""
    with atomic_write(path, what, text=True, durable=durable) as f:
        f.write(text)
    return Path(path)


def write_bytes(
    path: str | Path, data: bytes, what: str = "file", durable: bool = True, clean: bool = True
) -> Path:
    """Writes ``data`` to ``path`` with :func:`atomic_write`; returns ``path``."""
    with atomic_write(path, what, durable=durable, clean=clean) as f:
        f.write(data)
    return Path(path)


# -------------------------------------------------------------------------------------------- folder lock
def lock_holder(folder: str | Path) -> dict[str, Any] | None:
    """What the lock file of ``folder`` says about its holder (``pid``, ``host``, ``since``, ``command``),
    or ``None`` where there is none or it cannot be read."""
    try:
        holder = json.loads((Path(folder) / LOCK_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _claim(fd: int) -> bool:
    """Takes the lock of the open lock file ``fd``; ``False`` if a live process holds it."""
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True
    try:
        holder = json.loads(os.read(fd, 1 << 16) or b"{}")
    except ValueError:
        return True
    pid = holder.get("pid") if isinstance(holder, dict) else None
    return not (isinstance(pid, int) and pid != os.getpid() and _pid_alive(pid))


def _held_by_another(folder: Path, hint: str) -> ConfigError:
    holder = None
    for _ in range(20):  # the holder writes its name right after it took the lock
        holder = lock_holder(folder)
        if holder and holder.get("pid"):
            break
        time.sleep(0.05)
    holder = holder or {}
    host = holder.get("host")
    where = f" on {host}" if host and host != socket.gethostname() else ""
    since = f", since {holder['since']}" if holder.get("since") else ""
    return ConfigError(
        f"{folder} is held by a run that is still going (process {holder.get('pid', '?')}{where}{since}, "
        f"{LOCK_FILE}): wait for it to end, or {hint}"
    )


@contextlib.contextmanager
def hold_folder(
    folder: str | Path, hint: str = "give this run another folder (output=<folder>)"
) -> Iterator[Path]:
    """Holds the lock of ``folder`` (created if need be) while the body runs: ``<folder>/.vit3.lock``, an
    exclusive ``flock`` that the system releases when the process ends, however it ends, and that names this
    process (pid, host, start time, command). A lock that a dead process left is taken over. At the end the
    lock file is removed, and so are the folders this call created if they are still empty (a run refused
    before it wrote anything leaves nothing).

    Raises:
        ConfigError: a live process (this one too, through another call) holds the lock: one line naming
            ``folder``, the holder's process id and the ways on (``hint``).
    """
    folder = Path(folder)
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK_FILE
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        if not _claim(fd):
            os.close(fd)
            raise _held_by_another(folder, hint)
        try:  # the file may have been removed by the holder that released it between open and lock
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime()),
            "command": " ".join(sys.argv),
        }
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(me).encode())
        yield folder
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()
        os.close(fd)
        for created in made:  # deepest first
            with contextlib.suppress(OSError):
                created.rmdir()
