"""A checkpoint's tensors read in the pass that hashes it (agent/nonfinite.py, agent/tensor_scan.py,
agent/torch_storages.py): every NaN and infinity found, at its element, in each format; every finite
value let through, however large; the SHA256 always that of the whole file; no pickle ever run."""

from __future__ import annotations

import hashlib
import io
import math
import os
import pickle
import struct
import zipfile

import pytest

from agent import nonfinite, ranks
from agent.nonfinite import first_nan, first_nonfinite
from agent.tensor_scan import READ_CHUNK, scan_file
from agent.torch_storages import float_storages
from agent.trainer.safetensors_file import HostTensor, write_safetensors

NAN, INF = float("nan"), float("inf")


def _f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def _bf16(*values: float) -> bytes:
    """bfloat16 is float32's top two bytes."""
    packed = _f32(*values)
    return b"".join(packed[i + 2:i + 4] for i in range(0, len(packed), 4))


LAYOUTS = [
    (nonfinite.F64, lambda *v: struct.pack(f"<{len(v)}d", *v), 1.7e308),
    (nonfinite.F32, _f32, 3.4e38),
    (nonfinite.BF16, _bf16, 3.3e38),
    (nonfinite.F16, lambda *v: struct.pack(f"<{len(v)}e", *v), 65504.0),
]


@pytest.mark.parametrize(("layout", "pack", "largest"), LAYOUTS, ids=[entry[0].name for entry in LAYOUTS])
def test_each_float_type_finds_its_first_nan_or_infinity_and_passes_its_largest_finite_value(layout, pack, largest):
    assert first_nan(pack(0.5, -INF, INF, largest), layout) is None  # infinities alone: kept
    assert first_nan(pack(0.5, -INF, NAN), layout) == nonfinite.Found(2, "NaN")
    assert first_nonfinite(pack(0.0, -1.5, largest, -largest, 1e-3), layout) is None
    found = first_nonfinite(pack(1.0, largest, 2.0, NAN, -INF), layout)  # a huge value first: the exact test
    assert found == nonfinite.Found(3, "NaN")
    assert first_nonfinite(pack(0.5, -INF, NAN), layout) == nonfinite.Found(1, "-inf")
    assert first_nonfinite(pack(INF), layout) == nonfinite.Found(0, "inf")
    # -NaN (sign bit set) is a NaN too
    assert first_nonfinite(pack(1.0, math.copysign(NAN, -1.0)), layout) == nonfinite.Found(1, "NaN")


def test_the_8_bit_floats_find_their_non_finite_patterns():
    e5m2 = bytes([0x3C, 0x7B, 0xFC, 0x7E])  # 1.0, the largest finite, -inf, NaN
    assert first_nonfinite(e5m2[:2], nonfinite.F8_E5M2) is None
    assert first_nonfinite(e5m2, nonfinite.F8_E5M2) == nonfinite.Found(2, "-inf")
    e4m3 = bytes([0x38, 0x7E, 0xFE, 0xFF])  # 1.0, 448, -448, NaN (e4m3fn has no infinity)
    assert first_nonfinite(e4m3, nonfinite.F8_E4M3) == nonfinite.Found(3, "NaN")
    assert first_nan(e5m2[:3], nonfinite.F8_E5M2) is None and first_nan(e5m2, nonfinite.F8_E5M2).index == 3
    assert first_nan(e4m3, nonfinite.F8_E4M3) == nonfinite.Found(3, "NaN")


def _safetensors_file(path, tensors: dict[str, HostTensor]) -> str:
    with open(path, "wb") as handle:
        write_safetensors(handle, tensors)
    return str(path)


def _sha256(path) -> str:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def test_a_safetensors_file_is_hashed_whole_and_its_float_tensors_read(tmp_path):
    good = _safetensors_file(tmp_path / "good.safetensors", {
        "a.weight": HostTensor("F32", (3,), _f32(1, 2, 3)), "b.scale": HostTensor("BF16", (2,), _bf16(1, -2)),
        "steps": HostTensor("I64", (1,), struct.pack("<q", -1))})  # -1 is all bits set: not a float, not read
    scan = scan_file(good)
    assert scan.sha256 == _sha256(good) and scan.bad is None and scan.values_read == 2
    bad = _safetensors_file(tmp_path / "bad.safetensors", {
        "a.weight": HostTensor("F32", (3,), _f32(1, 2, 3)), "b.scale": HostTensor("BF16", (2,), _bf16(1, NAN))})
    scan = scan_file(bad)
    assert scan.sha256 == _sha256(bad)
    assert (scan.bad.tensor, scan.bad.value, scan.bad.element, scan.bad.dtype) == ("b.scale", "NaN", 1, "bfloat16")


def test_a_value_far_into_a_large_tensor_is_found_at_its_element(tmp_path):
    count = 3 * READ_CHUNK // 4 + 5  # three chunks and a bit
    values = bytearray(_f32(0.25) * count)
    values[4 * 5:4 * 6] = _f32(-INF)  # an infinity alone is kept: a mask buffer holds them by design
    values[4 * (count - 2):4 * (count - 1)] = _f32(NAN)
    path = _safetensors_file(tmp_path / "big.safetensors", {"w": HostTensor("F32", (count,), bytes(values))})
    scan = scan_file(path)
    assert scan.sha256 == _sha256(path) and scan.bad is not None
    assert (scan.bad.element, scan.bad.value) == (count - 2, "NaN")


def test_a_tensor_of_infinities_alone_is_kept_and_a_nan_among_them_is_found(tmp_path):
    mask = struct.pack("<6f", 0.0, -INF, -INF, 0.0, -INF, INF)  # a causal mask buffer saved with the weights
    path = _safetensors_file(tmp_path / "mask.safetensors", {"mask": HostTensor("F32", (6,), mask),
                                                             "w": HostTensor("BF16", (2,), _bf16(1, -INF))})
    assert scan_file(path).bad is None and scan_file(path).values_read == 2
    bad = _safetensors_file(tmp_path / "bad.safetensors", {"mask": HostTensor("F32", (3,), _f32(-INF, -INF, NAN))})
    assert (scan_file(bad).bad.element, scan_file(bad).bad.value) == (2, "NaN")


@pytest.mark.parametrize("damage", ["cut", "not json", "past the end", "zip magic, no zip", "npy magic, no npy"])
def test_a_file_that_is_not_what_it_looks_like_is_still_hashed_whole(tmp_path, damage):
    path = tmp_path / "x.safetensors"
    _safetensors_file(path, {"w": HostTensor("F32", (4,), _f32(1, 2, 3, 4))})
    whole = path.read_bytes()
    data = {"cut": whole[:-6], "not json": whole[:8] + b"}" + whole[9:],
            "past the end": whole.replace(b"[0,16]", b"[0,99]"),
            "zip magic, no zip": b"PK\x03\x04" + os.urandom(3000),
            "npy magic, no npy": b"\x93NUMPY\x01\x00\xff\xff" + os.urandom(3000)}[damage]
    path.write_bytes(data)
    scan = scan_file(str(path))
    assert scan.sha256 == hashlib.sha256(data).hexdigest() and scan.bad is None


def test_torch_storages_are_named_from_the_pickle_without_running_it(tmp_path):
    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path}/ran",))

    assert float_storages(pickle.dumps({"x": Boom()}, protocol=2)) == {}
    assert float_storages(pickle.dumps({"x": Boom()}, protocol=5)) == {}
    assert not (tmp_path / "ran").exists()
    assert float_storages(b"not a pickle") is None


def test_a_torch_file_has_its_float_storages_read_and_a_nan_named_by_its_key(tmp_path):
    torch = pytest.importorskip("torch")
    model = {"layers.0.weight": torch.randn(64, 8), "layers.0.scale": torch.ones(8, dtype=torch.bfloat16),
             "steps": torch.tensor([-1], dtype=torch.int64)}
    optimizer = {"state": {0: {"exp_avg": torch.zeros(64, 8), "exp_avg_sq": torch.zeros(64, 8, dtype=torch.float64)}},
                 "param_groups": [{"lr": 1e-3}]}
    torch.save({"model": model, "optimizer": optimizer}, tmp_path / "good.pt")
    scan = scan_file(str(tmp_path / "good.pt"))
    assert scan.sha256 == _sha256(tmp_path / "good.pt") and scan.bad is None and scan.values_read == 4
    optimizer["state"][0]["exp_avg_sq"][3, 2] = NAN
    torch.save({"model": model, "optimizer": optimizer}, tmp_path / "bad.pt")
    bad = scan_file(str(tmp_path / "bad.pt")).bad
    assert (bad.tensor, bad.value, bad.element, bad.dtype) == ("optimizer.state.0.exp_avg_sq", "NaN", 26, "float64")
    model["layers.0.scale"][5] = NAN
    torch.save(model, tmp_path / "model.bin", pickle_protocol=4)  # STACK_GLOBAL instead of GLOBAL
    bad = scan_file(str(tmp_path / "model.bin")).bad
    assert (bad.tensor, bad.value, bad.element) == ("layers.0.scale", "NaN", 5)


def test_npy_and_npz_members_are_read_as_numpy_and_mlx_write_them(tmp_path):
    numpy = pytest.importorskip("numpy")
    numpy.save(tmp_path / "a.npy", numpy.array([[0.0, 1.0], [NAN, 2.0]]))
    bad = scan_file(str(tmp_path / "a.npy")).bad
    assert (bad.value, bad.element, bad.dtype) == ("NaN", 2, "float64")
    numpy.savez(tmp_path / "b.npz", ok=numpy.ones(5, dtype=numpy.float32), bad=numpy.array([1, NAN], numpy.float16))
    scan = scan_file(str(tmp_path / "b.npz"))
    assert scan.sha256 == _sha256(tmp_path / "b.npz") and (scan.bad.tensor, scan.bad.value) == ("bad", "NaN")
    numpy.savez_compressed(tmp_path / "c.npz", bad=numpy.array([NAN]))
    assert scan_file(str(tmp_path / "c.npz")).bad is None  # compressed: not read (docs say so)


def test_mlx_savez_bfloat16_is_read(tmp_path):
    mx = pytest.importorskip("mlx.core")
    mx.savez(str(tmp_path / "opt.npz"), m=mx.ones((4,)), v=mx.array([1.0, 2.0, NAN], dtype=mx.bfloat16))
    bad = scan_file(str(tmp_path / "opt.npz")).bad
    assert (bad.tensor, bad.value, bad.element, bad.dtype) == ("v", "NaN", 2, "bfloat16")


def test_a_zip_of_other_things_is_only_hashed(tmp_path):
    with zipfile.ZipFile(tmp_path / "notes.zip", "w") as archive:
        archive.writestr("data.txt", b"\xff" * 4096)
        archive.writestr("nested/x.npy", b"\x93NUMPY garbage")
    scan = scan_file(str(tmp_path / "notes.zip"))
    assert scan.sha256 == _sha256(tmp_path / "notes.zip") and scan.bad is None and scan.values_read == 0


def test_a_checkpoint_with_a_nan_is_listed_invalid_naming_its_file_tensor_and_value(tmp_path):
    directory = tmp_path / "checkpoints" / "j1" / "attempt-0"
    directory.mkdir(parents=True)
    _safetensors_file(directory / "0000010_adapters.safetensors", {"lora_a": HostTensor("F32", (2,), _f32(1, 2))})
    _safetensors_file(directory / "0000020_adapters.safetensors", {"lora_a": HostTensor("F32", (2,), _f32(1, NAN))})
    parts = directory / "0000030"
    parts.mkdir()
    _safetensors_file(parts / "model.safetensors", {"w": HostTensor("F16", (2,), struct.pack("<2e", NAN, 0))})
    (parts / "COMPLETE").write_text("")
    found = {c["iteration"]: c for c in ranks.list_checkpoints(str(tmp_path), "j1", 0)["checkpoints"]}
    assert found[10]["valid"] and found[10]["detail"] == "1 tensors, 1 float tensor read, no NaN"
    assert not found[20]["valid"] and found[20]["sha256"] is None
    assert found[20]["detail"] == "0000020_adapters.safetensors: tensor 'lora_a' holds NaN (float32 element 1)"
    assert found[20]["nonfinite"]["value"] == "NaN"
    model = next(f for f in found[30]["files"] if f["path"] == "model.safetensors")
    assert model["nonfinite"] == {"file": "model.safetensors", "tensor": "w", "value": "NaN", "element": 0,
                                  "dtype": "float16"}


def test_a_file_is_read_once_for_its_hash_and_values_and_again_only_when_it_changes(tmp_path, monkeypatch):
    path = _safetensors_file(tmp_path / "0000010_adapters.safetensors", {"w": HostTensor("F32", (1,), _f32(1))})
    reads: list[str] = []
    from agent import tensor_scan

    real = tensor_scan.scan_file
    monkeypatch.setattr(tensor_scan, "scan_file", lambda p: reads.append(p) or real(p))
    monkeypatch.setattr(ranks, "sha256_file", lambda p, size=None: pytest.fail("hashed a second time"))
    first = ranks.scanned_remembered(path)
    assert ranks.scanned_remembered(path) is first and ranks.sha256_remembered(path) == first.sha256
    assert len(reads) == 1
    ranks.remember_hash(path, first.sha256)  # as the relay does for a copy it received: values not read
    ranks.scanned_remembered(path)
    assert len(reads) == 2


def test_an_unreadable_pickle_member_names_no_storage(tmp_path):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02garbage")
        archive.writestr("archive/data/0", _f32(NAN))
    (tmp_path / "x.pt").write_bytes(buffer.getvalue())
    scan = scan_file(str(tmp_path / "x.pt"))
    assert scan.bad is None and scan.sha256 == hashlib.sha256(buffer.getvalue()).hexdigest()
