"""The kernel's 16-byte path really compiles to 128-bit loads and stores (checked in PTX for sm_90).

Compiling to PTX needs no GPU, so this runs on CPU machines too, wherever Triton's CUDA backend is.
"""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")


def _ptx_accesses(vec: int, page_elems: int) -> set[str]:
    """The global load/store instructions of the kernel compiled for sm_90 with int64 elements."""
    from hybridkv_kernels.copy_triton import copy_pages_kernel
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    # Under TRITON_INTERPRET the decorator returns an interpreter wrapper; compile the plain function.
    fn = JITFunction(getattr(copy_pages_kernel, "fn", copy_pages_kernel))
    sig = {"anchor": "*i64", "src_off": "*i64", "dst_off": "*i64",
           "PAGE_ELEMS": "constexpr", "BLOCK": "constexpr", "VEC": "constexpr"}
    try:
        consts = {"PAGE_ELEMS": page_elems, "BLOCK": 2048, "VEC": vec}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs={(0,): [["tt.divisibility", 16]]})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except TypeError as e:  # ASTSource's keywords changed across Triton releases
        pytest.skip(f"this Triton's ASTSource API differs: {e}")
    return set(re.findall(r"((?:ld|st)\.global[\w.:]*)", kernel.asm["ptx"]))


@pytest.mark.parametrize("page_elems", [401408, 401400])  # Qwen3.6-27B page in int64; a partial last block
def test_sixteen_byte_alignment_gives_128_bit_accesses(page_elems):
    ops = _ptx_accesses(2, page_elems)
    assert "st.global.v2.b64" in ops
    assert any(op.startswith("ld.global") and op.endswith("v2.b64") for op in ops)


def test_eight_byte_alignment_stays_scalar():
    # Without the hint Triton cannot prove 16-byte alignment of table offsets: the hint is what widens.
    ops = _ptx_accesses(1, 401408)
    assert "st.global.b64" in ops and not any("v2" in op for op in ops)
