"""Safe output files: the one way every cauto command writes a file (torch-free).

``write_atomic(path, data)`` writes to a temp file made by ``mkstemp`` in the target's folder and
then ``os.replace``s it onto the path, so a reader (or a crash) never sees half a file and an error
leaves no file behind. Missing folders are created. An existing path that is not a regular file (a
directory, a FIFO, a device node such as /dev/full, a socket) is refused, and a symbolic link is
replaced (the link itself, by a file) only with ``replace_symlink`` (the commands' --replace-symlink).
``check_output`` runs the same refusals up front, so a command can refuse before slow work.
Every error is an OutputError naming the user's path, never the temp file.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from cauto.plan.errors import OutputError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def check_output(path: str | os.PathLike, *, replace_symlink: bool = False) -> Path:
    """``path`` as a Path, or OutputError when writing it would not just make or replace a regular file."""
    path = Path(path)
    try:
        info = path.lstat()
    except FileNotFoundError:
        info = None
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror}") from None
    if info is not None and stat.S_ISLNK(info.st_mode):
        if not replace_symlink:
            raise OutputError(f"{path} is a symbolic link (to {os.readlink(path)}); pass --replace-symlink to replace "
                              "the link with a file, or give the link's target as the output")
    elif info is not None and not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _KINDS if test(info.st_mode)), "not a regular file")
        raise OutputError(f"{path} is {kind}, not a regular file; give the path of a file to write")
    for parent in path.parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise OutputError(f"cannot write {path}: {parent} is not a directory")
            break
    return path


def write_atomic(path: str | os.PathLike, data: str | bytes, *, replace_symlink: bool = False) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically (module docstring); return the path."""
    path = check_output(path, replace_symlink=replace_symlink)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create the folder {path.parent} for {path}: {exc.strerror}") from None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
        try:
            info = path.lstat()
            mode = stat.S_IMODE(info.st_mode) if stat.S_ISREG(info.st_mode) else None
        except FileNotFoundError:
            mode = None
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask  # mkstemp makes 0600; a new output is an ordinary file
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {exc.strerror or type(exc).__name__}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
