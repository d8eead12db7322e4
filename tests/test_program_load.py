"""dspark_compile/engine_dir/programs.py: a program loaded with memoised type hints is the program
torch loads, and the deserializer is left as it was after the block (also after an error)."""
import pytest
import torch

from dspark_compile.engine_dir.programs import faster_deserialization


class _Chain(torch.nn.Module):
    def forward(self, x, y):
        for i in range(12):
            x = torch.where(x > 0, x * y, x.sin()) + i
        return x.sum(-1), x[:, :3]


def test_same_program_and_the_deserializer_restored(tmp_path):
    import typing

    from torch._export.serde import serialize
    ep = torch.export.export(_Chain(), (torch.randn(3, 5), torch.randn(5)))
    torch.export.save(ep, str(tmp_path / "p.pt2"))
    plain = torch.export.load(str(tmp_path / "p.pt2"))
    with faster_deserialization():
        assert serialize.typing is not typing
        fast = torch.export.load(str(tmp_path / "p.pt2"))
    assert serialize.typing is typing
    assert str(fast.graph) == str(plain.graph)
    assert fast.graph_signature == plain.graph_signature
    x, y = torch.randn(3, 5), torch.randn(5)
    for a, b in zip(fast.module()(x, y), plain.module()(x, y)):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="boom"):
        with faster_deserialization():
            raise RuntimeError("boom")
    assert serialize.typing is typing


# ------------------------------------------------------------------ untrusted archives
class _Weighted(torch.nn.Module):
    """A parameter, a buffer and a literal export lifts into a constant: every kind of tensor
    record a program archive holds."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(5, 5))
        self.register_buffer("b", torch.randn(5))

    def forward(self, x):
        return (x @ self.w + self.b) * torch.tensor([2.0, 1.0, 1.0, 1.0, 1.0])


def _archive(tmp_path) -> bytes:
    ep = torch.export.export(_Weighted(), (torch.randn(3, 5),))
    ep.example_inputs = None          # save_engine drops them (a pickle)
    torch.export.save(ep, str(tmp_path / "p.pt2"))
    return (tmp_path / "p.pt2").read_bytes()


def _info(data: bytes) -> dict:
    import hashlib
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def test_a_plain_program_passes_and_loads_as_torch_loads_it(tmp_path):
    from dspark_compile.engine_dir.programs import check_program_archive, load_program_file
    data = _archive(tmp_path)
    check_program_archive(data, "p.pt2")
    plain = torch.export.load(str(tmp_path / "p.pt2"))
    with faster_deserialization():                    # re-entered inside: no deadlock
        ours = load_program_file(tmp_path, "p.pt2", _info(data))
    assert str(ours.graph) == str(plain.graph)
    x = torch.randn(3, 5)
    assert torch.equal(ours.module()(x), plain.module()(x))


class _ReaderWithoutSize:
    """torch 2.11's PyTorchFileReader: records and their bytes, no size query."""

    def __init__(self, reader):
        self._reader = reader

    def get_all_records(self):
        return self._reader.get_all_records()

    def get_record(self, name):
        return self._reader.get_record(name)


def test_record_sizes_are_the_same_with_or_without_the_readers_size_query(tmp_path, monkeypatch):
    """torch 2.11's reader lacks get_record_size (a GPU load there failed with AttributeError):
    the archive check measures a record by its bytes there, to the same numbers."""
    import io
    from dspark_compile.engine_dir import programs
    data = _archive(tmp_path)
    reader = torch._C.PyTorchFileReader(io.BytesIO(data))
    old = _ReaderWithoutSize(reader)
    assert not hasattr(old, "get_record_size")
    names = list(reader.get_all_records())
    assert names and [programs.record_size(old, n) for n in names] == \
        [len(reader.get_record(n)) for n in names]
    if hasattr(reader, "get_record_size"):
        assert [programs.record_size(reader, n) for n in names] == \
            [reader.get_record_size(n) for n in names]
    real = torch._C.PyTorchFileReader                 # the whole check with torch 2.11's reader
    monkeypatch.setattr(torch._C, "PyTorchFileReader", lambda f: _ReaderWithoutSize(real(f)))
    programs.check_program_archive(data, "p.pt2")


def _rewritten(data: bytes, edit) -> bytes:
    import io
    import zipfile
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        items = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    root = items[0][0].split("/")[0]
    records = {n[len(root) + 1:]: d for n, d in items}
    edit(records)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for n, d in records.items():
            z.writestr(f"{root}/{n}", d)
    return out.getvalue()


def _config(name: str, change):
    import json

    def edit(records):
        obj = json.loads(records[name])
        change(next(iter(obj["config"].values())), records)
        records[name] = json.dumps(obj).encode()
    return edit


_W = "data/weights/model_weights_config.json"


def _meta(key, value):
    return lambda e, r: e["tensor_meta"].__setitem__(key, value)


def _size0(value):
    return lambda e, r: e["tensor_meta"]["sizes"].__setitem__(0, {"as_int": value})


@pytest.mark.parametrize("change, says", [
    (_size0(1 << 40), "reaches"),
    (_meta("storage_offset", {"as_int": 10 ** 6}), "reaches"),
    (_size0(-1), "plain non-negative ints"),
    (_meta("sizes", [{"as_expr": {"expr_str": "s0", "hint": None}}]),
     "plain non-negative ints"),
    (_meta("dtype", 99), "unknown dtype 99"),
    (_meta("device", {"type": "evil", "index": None}), "on the device"),
    (_meta("strides", [{"as_int": 1}]), "sizes and 1 strides"),
    (lambda e, r: r.__setitem__("data/weights/" + e["path_name"], b""), "reaches"),
], ids=["huge_size", "offset_past_the_record", "negative_size", "symbolic_size",
        "unknown_dtype", "unknown_device", "strides_mismatch", "empty_record"])
def test_a_tensor_record_that_lies_about_its_bytes_is_refused(tmp_path, change, says):
    """A tensor's metadata must fit its record: torch would otherwise allocate what the
    metadata says (a zero-byte record becomes torch.zeros of its sizes) or read past it."""
    from dspark_compile.engine_dir.format import ArtifactError
    from dspark_compile.engine_dir.programs import check_program_archive
    data = _rewritten(_archive(tmp_path), _config(_W, change))
    with pytest.raises(ArtifactError, match=says):
        check_program_archive(data, "p.pt2")


def test_a_graph_nested_too_deep_or_not_an_archive_is_refused(tmp_path):
    from dspark_compile.engine_dir.format import ArtifactError
    from dspark_compile.engine_dir.programs import check_program_archive
    deep = _rewritten(_archive(tmp_path), lambda r: r.__setitem__(
        "models/model.json", b"[" * 100_000 + b"]" * 100_000))
    with pytest.raises(ArtifactError, match="not readable JSON"):
        check_program_archive(deep, "p.pt2")
    with pytest.raises(ArtifactError, match="not a readable archive"):
        check_program_archive(b"PK\x03\x04 not really", "p.pt2")


def test_a_program_whose_bytes_changed_is_refused(tmp_path):
    from dspark_compile.engine_dir.format import ArtifactError
    from dspark_compile.engine_dir.programs import load_program_file
    data = _archive(tmp_path)
    info = _info(data)
    (tmp_path / "p.pt2").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ArtifactError, match="'p.pt2' is corrupted"):
        load_program_file(tmp_path, "p.pt2", info)
