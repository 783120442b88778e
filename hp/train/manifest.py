"""A checkpoint's manifest: every file it holds, with its size and checksum, written last.

A run killed while a disk fills up, or a copy cut short, can leave a
checkpoint whose directory looks complete and whose files are not. A
checkpoint therefore ends with `manifest.json`, written after every other
file (and before the atomic rename that publishes it): each file's size in
bytes and CRC-32. `verify` reads the files back against it and names the
first one that differs (missing, cut short, or changed), so a resume can
skip to the previous checkpoint instead of failing inside a load, and a
damaged checkpoint named explicitly is refused by its damaged file.

A checkpoint written before manifests existed has none: it is taken as it
is (its `trainer_state.pt` still proves that its save finished).

CRC-32 finds a truncation and any flipped bit; it is no defence against
someone who edits a file on purpose (`hp.train.checkpoint` reads untrusted
files safely on its own).
"""

from __future__ import annotations

import json
import os
import zlib

MANIFEST = "manifest.json"
_CHUNK = 1 << 20


def write(directory: str) -> None:
    """Record every file under `directory` in its manifest (written to a temporary name, then renamed).

    >>> import tempfile, pathlib
    >>> d = tempfile.mkdtemp()
    >>> _ = pathlib.Path(d, "a.bin").write_bytes(b"hp")
    >>> write(d); verify(d) is None
    True
    """
    files = {name: {"bytes": os.path.getsize(os.path.join(directory, name)), "crc32": _crc32(directory, name)}
             for name in _files(directory)}
    temporary = os.path.join(directory, MANIFEST + ".tmp")
    with open(temporary, "w") as f:
        json.dump({"format": 1, "files": files}, f, indent=1, sort_keys=True)
    os.replace(temporary, os.path.join(directory, MANIFEST))


def verify(directory: str) -> str | None:
    """Why checkpoint `directory` cannot be trusted (naming the file), or None when its files match its
    manifest, or when it has none (written before manifests).

    >>> import tempfile, pathlib
    >>> d = tempfile.mkdtemp()
    >>> _ = pathlib.Path(d, "a.bin").write_bytes(b"hp")
    >>> write(d)
    >>> _ = pathlib.Path(d, "a.bin").write_bytes(b"h")
    >>> verify(d).endswith("a.bin is cut short: 1 bytes, the manifest says 2")
    True
    """
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            files = json.load(f)["files"]
        entries = [(name, int(entry["bytes"]), entry["crc32"]) for name, entry in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{path} cannot be read: {e}"
    for name, size, crc in sorted(entries):
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            return f"{file} is missing"
        have = os.path.getsize(file)
        if have != size:
            what = "is cut short" if have < size else "is longer than written"
            return f"{file} {what}: {have} bytes, the manifest says {size}"
        if _crc32(directory, name) != crc:
            return f"{file} has changed since it was written (its CRC-32 differs from the manifest's)"
    return None


def _files(directory: str) -> list[str]:
    """Every file under `directory`, relative to it, but the manifest itself."""
    found = []
    for root, _, names in os.walk(directory):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), directory)
            if relative not in (MANIFEST, MANIFEST + ".tmp"):
                found.append(relative)
    return sorted(found)


def _crc32(directory: str, name: str) -> str:
    crc = 0
    with open(os.path.join(directory, name), "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"
