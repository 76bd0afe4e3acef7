"""Getting a PEFT adapter's two files out of an upload, safely.

An upload is a ``.zip``, a ``.tar.gz`` or the two files themselves. Archives are
hostile until proven otherwise: only regular files are read (no links, devices or
FIFOs), no member may name an absolute path or climb out with ``..``, the number of
members and the bytes actually extracted are capped (a zip's declared sizes can lie,
so bytes are counted as they are written), and only ``adapter_config.json`` and
``adapter_model.safetensors`` are ever written out. A pickled ``adapter_model.bin`` is
refused, never opened.
"""

from __future__ import annotations

import stat
import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_CHUNK = 1 << 20


class ArchiveRejected(ValueError):
    """The upload is refused; the message says why, for a person."""


@dataclass(frozen=True, slots=True)
class Limits:
    max_members: int = 64
    max_bytes: int = 4 << 30  # bytes extracted in all (the two files)
    max_config_bytes: int = 1 << 20


def sniff(head: bytes) -> str:
    """'zip', 'tar.gz' or 'unknown' from a file's first bytes."""
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "zip"
    if head.startswith(b"\x1f\x8b"):
        return "tar.gz"
    return "unknown"


def _check_name(name: str) -> PurePosixPath:
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise ArchiveRejected(f"member {name!r} has an absolute path")
    if ".." in path.parts:
        raise ArchiveRejected(f"member {name!r} climbs out of the archive with '..'")
    return path


def _pick(names: dict[str, object]) -> dict[str, object]:
    """The config and weights among the members (one of each, anywhere in the tree)."""
    found: dict[str, list[str]] = {CONFIG: [], WEIGHTS: [], "adapter_model.bin": []}
    for name in names:
        base = PurePosixPath(name).name
        if base in found:
            found[base].append(name)
    if not found[WEIGHTS]:
        if found["adapter_model.bin"]:
            raise ArchiveRejected("the weights are a pickle (adapter_model.bin); upload "
                                  "adapter_model.safetensors instead (save_pretrained writes "
                                  "it by default), since unpickling can run arbitrary code")
        raise ArchiveRejected(f"the archive holds no {WEIGHTS}")
    if not found[CONFIG]:
        raise ArchiveRejected(f"the archive holds no {CONFIG}")
    for wanted in (CONFIG, WEIGHTS):
        if len(found[wanted]) > 1:
            raise ArchiveRejected(f"the archive holds {len(found[wanted])} copies of {wanted}")
    return {CONFIG: names[found[CONFIG][0]], WEIGHTS: names[found[WEIGHTS][0]]}


def _copy(src: BinaryIO, dest: Path, budget: list[int], limit_note: str) -> None:
    with dest.open("wb") as out:
        for chunk in iter(lambda: src.read(_CHUNK), b""):
            budget[0] -= len(chunk)
            if budget[0] < 0:
                raise ArchiveRejected(f"the adapter expands to more than {limit_note}")
            out.write(chunk)


def extract(archive: Path, out_dir: Path, limits: Limits = Limits()) -> Path:
    """Writes the adapter's two files from ``archive`` into ``out_dir``; returns it."""
    with archive.open("rb") as f:
        kind = sniff(f.read(4))
    out_dir.mkdir(parents=True, exist_ok=True)
    budget = [limits.max_bytes]
    note = f"{limits.max_bytes:,} bytes"
    try:
        if kind == "zip":
            _extract_zip(archive, out_dir, limits, budget, note)
        elif kind == "tar.gz":
            _extract_tar(archive, out_dir, limits, budget, note)
        else:
            raise ArchiveRejected("the upload is neither a .zip nor a .tar.gz archive")
    except ArchiveRejected:
        raise
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise ArchiveRejected(f"the archive is corrupt: {exc}") from None
    except (NotImplementedError, RuntimeError, ValueError) as exc:
        # zipfile's answers to a compression method it lacks, an encryption it cannot
        # read, or a header that makes no sense: all the archive's fault, none a crash.
        raise ArchiveRejected(f"the archive cannot be read: {exc}") from None
    if (out_dir / CONFIG).stat().st_size > limits.max_config_bytes:
        raise ArchiveRejected(f"{CONFIG} is larger than {limits.max_config_bytes:,} bytes")
    return out_dir


def _extract_zip(archive: Path, out_dir: Path, limits: Limits, budget: list[int],
                 note: str) -> None:
    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        if len(infos) > limits.max_members:
            raise ArchiveRejected(f"the archive has {len(infos)} members; at most "
                                  f"{limits.max_members} are accepted")
        members: dict[str, object] = {}
        for info in infos:
            _check_name(info.filename)
            mode = info.external_attr >> 16  # Unix mode, when the zip's maker wrote one
            if stat.S_IFMT(mode) and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
                raise ArchiveRejected(f"member {info.filename!r} is {kind}")
            if info.flag_bits & 0x1:
                raise ArchiveRejected(f"member {info.filename!r} is encrypted")
            if not info.is_dir():
                members[info.filename] = info
        picked = _pick(members)
        if sum(info.file_size for info in picked.values()) > limits.max_bytes:
            raise ArchiveRejected(f"the adapter expands to more than {note}")
        for target, info in picked.items():
            with zf.open(info) as src:
                _copy(src, out_dir / target, budget, note)


def _extract_tar(archive: Path, out_dir: Path, limits: Limits, budget: list[int],
                 note: str) -> None:
    with tarfile.open(archive, mode="r:gz") as tf:
        members: dict[str, object] = {}
        declared = 0
        for count, info in enumerate(_iter_tar(tf), start=1):
            if count > limits.max_members:
                raise ArchiveRejected(f"the archive has more than {limits.max_members} "
                                      f"members")
            # NOTE: stepping over a member decompresses it, so every member's size counts,
            # not just the two files kept: a tar.gz of one huge README is a bomb too.
            declared += max(info.size, 0)
            if declared > budget[0]:
                raise ArchiveRejected(f"the archive expands to more than {note}")
            _check_name(info.name)
            if info.issym() or info.islnk():
                raise ArchiveRejected(f"member {info.name!r} is a link")
            if not (info.isfile() or info.isdir()):
                raise ArchiveRejected(f"member {info.name!r} is not a regular file")
            if info.isfile():
                members[info.name] = info
        for target, info in _pick(members).items():
            src = tf.extractfile(info)
            if src is None:
                raise ArchiveRejected(f"member {info.name!r} cannot be read")
            _copy(src, out_dir / target, budget, note)


def _iter_tar(tf: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    # NOTE: next() reads headers one at a time, so a huge member count is refused early
    # instead of being listed in full first.
    while (info := tf.next()) is not None:
        yield info
