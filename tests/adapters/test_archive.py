"""Safe extraction of uploaded archives: only the adapter's two files, never anything else."""

from __future__ import annotations

import io
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from adapters.archive import ArchiveRejected, Limits, extract

CONFIG = b'{"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}'
WEIGHTS = b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "  # content is not checked here


def make_zip(path: Path, members: dict[str, bytes], *, symlinks: dict[str, str] | None = None,
             compression=zipfile.ZIP_DEFLATED) -> Path:
    with zipfile.ZipFile(path, "w", compression) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        for name, target in (symlinks or {}).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, target)
    return path


def make_tar(path: Path, members: dict[str, bytes], *, links: dict[str, str] | None = None,
             devices: list[str] = ()) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tf.addfile(info)
        for name in devices:
            info = tarfile.TarInfo(name)
            info.type = tarfile.CHRTYPE
            tf.addfile(info)
    return path


GOOD = {"my-adapter/adapter_config.json": CONFIG,
        "my-adapter/adapter_model.safetensors": WEIGHTS, "my-adapter/README.md": b"hi"}


@pytest.mark.parametrize("maker", [make_zip, make_tar])
def test_the_two_files_come_out_and_nothing_else(tmp_path, maker):
    out = extract(maker(tmp_path / "a", GOOD), tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json",
                                                      "adapter_model.safetensors"]
    assert (out / "adapter_config.json").read_bytes() == CONFIG


@pytest.mark.parametrize("maker, members, kwargs, reason", [
    (make_zip, {"../../etc/adapter_config.json": CONFIG,
                "adapter_model.safetensors": WEIGHTS}, {}, "climbs out"),
    (make_tar, {"/etc/adapter_config.json": CONFIG, "adapter_model.safetensors": WEIGHTS},
     {}, "absolute"),
    (make_zip, GOOD, {"symlinks": {"evil": "/etc/passwd"}}, "symbolic link"),
    (make_tar, GOOD, {"links": {"evil": "/etc/passwd"}}, "link"),
    (make_tar, GOOD, {"devices": ["dev"]}, "not a regular file"),
    (make_zip, {"adapter_config.json": CONFIG, "adapter_model.bin": b"\x80\x04pickle"}, {},
     "pickle"),
    (make_zip, {"adapter_config.json": CONFIG}, {}, "no adapter_model.safetensors"),
    (make_zip, {"a/adapter_config.json": CONFIG, "b/adapter_config.json": CONFIG,
                "adapter_model.safetensors": WEIGHTS}, {}, "2 copies"),
])
def test_hostile_or_incomplete_archives_are_refused(tmp_path, maker, members, kwargs, reason):
    with pytest.raises(ArchiveRejected, match=reason):
        extract(maker(tmp_path / "a", members, **kwargs), tmp_path / "out")


def test_a_zip_bomb_is_refused_while_extracting(tmp_path):
    bomb = make_zip(tmp_path / "bomb.zip", {"adapter_config.json": CONFIG,
                                            "adapter_model.safetensors": b"\0" * (50 << 20)})
    assert bomb.stat().st_size < 200_000  # 50 MB of zeros compresses to almost nothing
    with pytest.raises(ArchiveRejected, match="expands to more than"):
        extract(bomb, tmp_path / "out", Limits(max_bytes=10 << 20))


def test_a_zip_lying_about_its_sizes_is_caught_by_counting_bytes(tmp_path):
    path = make_zip(tmp_path / "liar.zip", {"adapter_config.json": CONFIG,
                                            "adapter_model.safetensors": b"\1" * (3 << 20)})
    data = bytearray(path.read_bytes())
    # Rewrite the central directory's uncompressed size of the weights to 10 bytes.
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("adapter_model.safetensors")
    central = data.rfind(b"PK\x01\x02", 0, data.rfind(b"adapter_model.safetensors") + 1)
    data[central + 24:central + 28] = (10).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    assert info.file_size == 3 << 20
    with pytest.raises(ArchiveRejected):
        extract(path, tmp_path / "out", Limits(max_bytes=1 << 20))


def test_too_many_members_and_garbage_are_refused(tmp_path):
    many = make_zip(tmp_path / "many.zip", {**GOOD, **{f"junk/{i}": b"" for i in range(100)}})
    with pytest.raises(ArchiveRejected, match="members"):
        extract(many, tmp_path / "out", Limits(max_members=10))
    (tmp_path / "garbage").write_bytes(b"this is not an archive")
    with pytest.raises(ArchiveRejected, match="neither"):
        extract(tmp_path / "garbage", tmp_path / "out2")
    truncated = make_zip(tmp_path / "t.zip", GOOD)
    truncated.write_bytes(truncated.read_bytes()[:60])
    with pytest.raises(ArchiveRejected, match="corrupt"):
        extract(truncated, tmp_path / "out3")


def test_a_zip_with_a_compression_method_python_lacks_is_refused(tmp_path):
    path = make_zip(tmp_path / "a.zip", GOOD, compression=zipfile.ZIP_STORED)
    data = bytearray(path.read_bytes())
    # Rewrite every header's method field (local headers at +8, central ones at +10) to 99
    # (AES), which zipfile cannot decompress.
    for signature, offset in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):
        start = 0
        while (at := data.find(signature, start)) >= 0:
            data[at + offset:at + offset + 2] = (99).to_bytes(2, "little")
            start = at + 4
    path.write_bytes(bytes(data))
    with pytest.raises(ArchiveRejected, match="cannot be read"):
        extract(path, tmp_path / "out")


def test_a_zip_with_a_corrupt_deflate_stream_is_refused(tmp_path):
    weights = bytes(range(256)) * 64
    path = make_zip(tmp_path / "a.zip", {**GOOD, "my-adapter/adapter_model.safetensors": weights})
    data = bytearray(path.read_bytes())
    local = data.find(b"PK\x03\x04", data.find(b"adapter_model.safetensors") - 64)
    name_len = int.from_bytes(data[local + 26:local + 28], "little")
    extra_len = int.from_bytes(data[local + 28:local + 30], "little")
    body = local + 30 + name_len + extra_len
    data[body:body + 8] = b"\xff" * 8  # an invalid deflate block type
    path.write_bytes(bytes(data))
    with pytest.raises(ArchiveRejected):
        extract(path, tmp_path / "out")


def test_a_tar_bomb_in_a_member_never_kept_is_refused_before_it_is_inflated(tmp_path):
    # 64 MiB of zeros in a README compresses to ~64 KiB; skipping it would inflate it all.
    path = tmp_path / "bomb.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for name, data in GOOD.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("my-adapter/zeros.bin")
        info.size = 64 << 20
        tf.addfile(info, io.BytesIO(bytes(info.size)))
    assert path.stat().st_size < 1 << 20
    with pytest.raises(ArchiveRejected, match="expands to more than"):
        extract(path, tmp_path / "out", Limits(max_bytes=16 << 20))
