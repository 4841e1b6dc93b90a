"""The seed's wire formats, kept as baselines: a typed tensor serialized with pickle or torch.save.

Both sides pay a full serialize and deserialize per object, and the server must import torch to
decode them. That cost is the point of keeping them: it is what the seed system paid.
"""

from __future__ import annotations

import io
import pickle


class PayloadError(ValueError):
    """A payload frame that does not decode to the object it claims to be."""


def _torch():
    import torch  # only the legacy formats need torch; the server imports it on first use

    return torch


def encode_tensor(fmt: str, tensor) -> bytes:
    """Serialize a CPU tensor the way the seed did."""
    if fmt == "pickle":
        return pickle.dumps(tensor, protocol=pickle.HIGHEST_PROTOCOL)
    if fmt == "torch_save":
        buf = io.BytesIO()
        _torch().save(tensor, buf)
        return buf.getvalue()
    raise PayloadError(f"unknown legacy format {fmt!r}")


def decode_tensor(fmt: str, frame: bytes | memoryview):
    """Deserialize a frame made by encode_tensor; anything else is a PayloadError, never executed code."""
    torch = _torch()
    try:
        if fmt == "pickle":
            # The seed unpickled whatever arrived; restrict to tensors so a frame cannot run code here.
            t = _TensorUnpickler(io.BytesIO(frame)).load()
        elif fmt == "torch_save":
            t = torch.load(io.BytesIO(frame), weights_only=True, map_location="cpu")
        else:
            raise PayloadError(f"unknown legacy format {fmt!r}")
    except PayloadError:
        raise
    except Exception as e:
        raise PayloadError(f"{fmt} payload does not decode: {type(e).__name__}: {e}") from None
    if not isinstance(t, torch.Tensor):
        raise PayloadError(f"{fmt} payload decodes to {type(t).__name__}, not a tensor")
    return t


def bytes_to_tensor(data: memoryview, dtype: str):
    """A tensor of `dtype` sharing `data`'s memory (no copy)."""
    torch = _torch()
    return torch.frombuffer(data, dtype=torch.uint8).view(getattr(torch, dtype))


def copy_tensor_into(t, out: memoryview) -> None:
    """Copy a decoded tensor's bytes into `out`, which must be exactly its size."""
    torch = _torch()
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.numel() != len(out):
        raise PayloadError(f"payload holds {flat.numel()} B, the object is {len(out)} B")
    torch.frombuffer(out, dtype=torch.uint8).copy_(flat)


# How the legacy format names the storage of a tensor pickled by _rebuild_tensor_v3 (fp8 and other
# dtypes without a typed storage class), and the uint8 storage class that holds the same bytes.
_UNTYPED_GLOBAL = b"ctorch.storage\nUntypedStorage\n"
_BYTE_GLOBAL = b"ctorch\nByteStorage\n"


def _load_storage_weights_only(data: bytes):
    """torch.storage._load_from_bytes without its weights_only=False: the nested torch.save is data only.

    torch's weights-only loader cannot rebuild an UntypedStorage (it asks it for a dtype), so the one
    global naming it is read as ByteStorage: one byte per element, the same bytes.
    """
    if data.count(_UNTYPED_GLOBAL) == 1:
        data = data.replace(_UNTYPED_GLOBAL, _BYTE_GLOBAL)
    return _torch().load(io.BytesIO(data), weights_only=True, map_location="cpu")


def _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    """torch._utils._rebuild_tensor_v3 for a storage from torch.load(weights_only=True), untyped there."""
    torch = _torch()
    untyped = getattr(storage, "_untyped_storage", storage)
    if not isinstance(untyped, torch.UntypedStorage) or not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"tensor v3 needs a storage and a dtype, got {type(storage).__name__} "
                                     f"and {type(dtype).__name__}")
    return torch.empty((0,), dtype=dtype).set_(untyped, offset, size, stride)


class _TensorUnpickler(pickle.Unpickler):
    """Unpickles exactly what pickle.dumps(tensor) produces and nothing that could run code.

    A pickled tensor names three globals (four for dtypes the v2 rebuild cannot express, such as fp8:
    `_rebuild_tensor_v3` and the dtype itself); every other name is refused (a frame from the network
    must never pick a callable), and the nested storage is loaded with torch.load(weights_only=True).
    """

    def find_class(self, module: str, name: str):
        torch = _torch()
        allowed = {
            ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
            ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
            ("torch.storage", "_load_from_bytes"): _load_storage_weights_only,
            ("collections", "OrderedDict"): __import__("collections").OrderedDict,
        }
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # a dtype is data, not a callable that could run code
        try:
            return allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}: only tensors are accepted") from None
