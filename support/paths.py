"""paths.py - where an output may go, checked before a run writes anything: the nearest folder
that exists on its way, and whether that folder takes new files (asked of the filesystem itself,
so that a wrong path fails at once, not when the first result is written after the work)."""

import os
import tempfile


def nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_can_write(flag: str, path: str, folder: str | None = None) -> None:
    """The output `path` (what `flag` names) will be written into `folder` (default: the folder
    that holds `path`), which may not exist yet (missing folders are made then): the nearest
    existing folder on the way must be a folder that takes new files. access() says yes to root
    everywhere (/proc too), so a folder is made there and removed."""
    existing = nearest_existing(folder or os.path.dirname(os.path.abspath(path)))
    if not os.path.isdir(existing):
        raise ValueError(f"{flag} {path!r} cannot be written: {existing!r} is a file, not a "
                         f"folder")
    try:
        if not os.access(existing, os.W_OK | os.X_OK):
            raise PermissionError("not writable")
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=existing))
    except OSError as error:
        raise ValueError(f"{flag} {path!r} cannot be written: {existing!r}: "
                         f"{error.strerror or error}") from None
