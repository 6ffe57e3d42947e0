"""loom's GGUF reader against gguf's own GGUFReader (the reference), on every kind of metadata
value and tensor type the loader meets, and its errors on files it cannot read."""

from __future__ import annotations

import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest
from model_fixtures import TINY_SPECS, build_tiny_model, write_gguf

from loom.model.arch import default_model_path
from loom.model.gguf_file import (
    _NATIVE_TYPES,
    GGUFFormatError,
    GGUFTensor,
    dequantize,
    read_gguf,
    tensor_type,
)


def reference(path) -> tuple[dict, list[tuple[str, tuple[int, ...], object, np.ndarray]]]:
    reader = gguf.GGUFReader(str(path))
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = [(t.name, tuple(reversed(t.shape.tolist())), t.tensor_type.name,
                np.asarray(t.data).view(np.uint8).reshape(-1)) for t in reader.tensors]
    return metadata, tensors


def assert_same_as_reference(path) -> None:
    metadata, tensors = reference(path)
    ours = read_gguf(path)
    if "test.nested" in metadata:  # gguf's contents() flattens arrays of arrays
        assert ours.metadata.pop("test.nested") == [[1, 2], [3]]
        assert metadata.pop("test.nested") == [1, 2, 3]
    assert ours.metadata == metadata
    assert [(t.name, t.shape, t.kind) for t in ours.tensors] == [t[:3] for t in tensors]
    for t, (_, _, _, data) in zip(ours.tensors, tensors):
        np.testing.assert_array_equal(t.data.reshape(-1), data)
        assert t.data.dtype == np.uint8 and t.data.shape[:-1] == t.shape[:-1]


@pytest.fixture(scope="module")
def tiny_llama():
    return build_tiny_model(TINY_SPECS["llama"])


@pytest.mark.unit
@pytest.mark.parametrize("quant", [None, "Q4_0", "Q4_1", "Q8_0", "F16"])
def test_reads_what_gguf_reads(tmp_path, tiny_llama, quant, monkeypatch) -> None:
    """Every metadata value type (arrays of strings, numbers and arrays included), at a
    non-default alignment, with F32, F16 and block-quantized tensors."""
    real = gguf.GGUFWriter.add_chat_template

    def with_every_value_type(self, template):
        real(self, template)
        self.add_custom_alignment(64)
        for i, add in enumerate((self.add_uint8, self.add_int8, self.add_uint16, self.add_int16,
                                 self.add_uint32, self.add_int32, self.add_uint64,
                                 self.add_int64)):
            add(f"test.int.{i}", 7 - i)
        self.add_float32("test.f32", 0.25)
        self.add_float64("test.f64", -1e300)
        self.add_bool("test.bool", True)
        self.add_string("test.unicode", "ünï – 字")
        self.add_array("test.floats", [0.5, 1.5])
        self.add_array("test.nested", [[1, 2], [3]])
        self.add_array("test.empty", [])

    monkeypatch.setattr(gguf.GGUFWriter, "add_chat_template", with_every_value_type)
    assert_same_as_reference(write_gguf(tiny_llama, tmp_path / "t.gguf", quant=quant))


@pytest.mark.integration
def test_reads_the_bundled_model_as_gguf_does() -> None:
    assert_same_as_reference(default_model_path())


@pytest.mark.unit
def test_errors_name_the_problem(tmp_path, tiny_llama) -> None:
    good = write_gguf(tiny_llama, tmp_path / "good.gguf", quant="Q4_1").read_bytes()
    cases = {
        "magic.gguf": (b"GGML" + good[4:], "not a GGUF file"),
        "version.gguf": (good[:4] + struct.pack("<I", 1) + good[8:], "version 1 is not supported"),
        "big-endian.gguf": (good[:4] + struct.pack(">I", 3) + good[8:], "big-endian"),
        "header.gguf": (good[:200], "header is truncated"),
        "data.gguf": (good[:-100], r"truncated: tensor '.*' ends past the file"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(GGUFFormatError, match=message):
            read_gguf(path)


@pytest.mark.unit
def test_types_it_sizes_itself_are_sized_as_gguf_sizes_them() -> None:
    for type_id, (name, block, size) in _NATIVE_TYPES.items():
        kind = gguf.GGMLQuantizationType(type_id)
        assert (kind.name, block, size) == (name, *gguf.GGML_QUANT_SIZES[kind])
    assert tensor_type(gguf.GGMLQuantizationType.Q6_K) == ("Q6_K", 256, 210)  # gguf's table
    with pytest.raises(ValueError):
        tensor_type(9999)


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q8_0"])
def test_dequantize_gives_what_gguf_gives(kind) -> None:
    values = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    quant = gguf.GGMLQuantizationType[kind]
    data = gguf.quants.quantize(values, quant).view(np.uint8).reshape(3, -1)
    ours = dequantize(GGUFTensor("t", (3, 64), kind, data))
    assert ours.dtype == np.float32 and ours.shape == (3, 64)
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(data, quant).reshape(3, 64))


@pytest.mark.integration
def test_loading_the_bundled_model_never_imports_gguf() -> None:
    """Its tensors are all of types loom sizes and reads itself: the gguf package's import
    stays out of start-up."""
    code = ("import sys; from loom.model.loader import load_model; m = load_model(None); "
            "m.weights['model.norm.weight']; print('gguf' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
