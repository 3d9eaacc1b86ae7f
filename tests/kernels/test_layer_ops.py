"""The compiled layer ops against Hugging Face's torch arithmetic (`TorchLayerOps`). In bfloat16 they
round where torch rounds: the residual add and RoPE are bit for bit; RMSNorm and SiLU, whose float32 sum
or exp can differ from torch's in the last bit, may flip a rare rounding by one bfloat16 step. In float32
they agree to float32 precision. The module skips where the compiled kernels do not build."""

from __future__ import annotations

import pytest
import torch

from compiled_kernels import COMPILED, SKIP_REASON
from kernels.layer_ops import CppLayerOps, TorchLayerOps, get_layer_ops, onednn_bf16

if not COMPILED:
    pytest.skip(SKIP_REASON, allow_module_level=True)
REF, CPP = TorchLayerOps(), CppLayerOps()
EPS = 1e-5
# the compiled GEMV needs AVX512-BF16; oneDNN's packed bfloat16 copies need its own bfloat16 path
needs_gemv = pytest.mark.skipif(CPP._gemv is None, reason="the CPU lacks AVX512-BF16: the GEMV is not built")
needs_onednn_bf16 = pytest.mark.skipif(not onednn_bf16(), reason="oneDNN has no bfloat16 path on this CPU")


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, exact: bool = True, steps: int = 1) -> None:
    """bfloat16: identical, or (`exact=False`) at most one value in 1,000 apart, by at most `steps` rounding
    steps."""
    if dtype == torch.bfloat16 and exact:
        assert torch.equal(a, b)
    elif dtype == torch.bfloat16:
        assert (a != b).float().mean() < 1e-3
        torch.testing.assert_close(a, b, atol=0, rtol=steps * 2 ** -7)
    else:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,width", [(1, 64), (37, 576), (300, 100), (2048, 576)])
def test_rms_norm(dtype, rows, width):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    w = (torch.rand(width, generator=gen) + 0.5).to(dtype)
    # RMSNorm rounds twice: the normalised value to bfloat16, then its product with the weight. A sum of
    # squares added in another order than torch's can flip the first rounding, which the weight (up to 1.5
    # here) then scales to up to 1.5 steps of the output; ~3 values in 10^6 differ (docs/benchmarks.md).
    _close(CPP.rms_norm(x, w, EPS), REF.rms_norm(x, w, EPS), dtype, exact=False, steps=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_updates_the_stream_in_place(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 576, generator=gen).to(dtype)
    delta = torch.randn(40, 576, generator=gen).to(dtype)
    w = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    ref_x, ref_h = REF.add_rms_norm(x, delta, w, EPS)
    stream = x.clone()
    out_x, out_h = CPP.add_rms_norm(stream, delta, w, EPS)
    assert out_x is stream
    _close(stream, ref_x, dtype)
    _close(out_h, ref_h, dtype, exact=False, steps=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 32, 128, 48])  # 48: halves not whole vectors
def test_rope_in_place_on_a_strided_view(dtype, head_dim):
    tokens, heads, extra = 33, 5, 3  # q and k heads inside a wider fused row, as the model calls it
    gen = torch.Generator().manual_seed(head_dim)
    freqs = torch.arange(2048.0)[:, None] * (1 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim))[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    positions = torch.randint(0, 2048, (tokens,), generator=gen)
    row = torch.randn(tokens, (heads + extra) * head_dim, generator=gen).to(dtype)
    a, b = row.clone(), row.clone()
    REF.rope_(a[:, : heads * head_dim].view(tokens, heads, head_dim), cos, sin, positions)
    CPP.rope_(b[:, : heads * head_dim].view(tokens, heads, head_dim), cos, sin, positions)
    _close(b, a, dtype)
    assert torch.equal(b[:, heads * head_dim:], row[:, heads * head_dim:])  # the rest of the row untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [1536, 40, 7])  # vector width, and ragged tails
def test_silu_and_mul(dtype, width):
    gen = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(64, 2 * width, generator=gen) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp overflow/underflow
    _close(CPP.silu_and_mul(gate_up), REF.silu_and_mul(gate_up), dtype, exact=False)


@pytest.mark.parametrize("width", [1, 15, 64, 65, 1000, 49152])  # scalar only, one vector group, tails
def test_argmax_matches_torch_bit_for_bit(width):
    """Each row's first maximum, as `max(dim=-1).indices`: ties take the first index (-0.0 ties +0.0), a NaN
    counts above every number and the first NaN wins, infinities and all -inf rows included."""
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(9, width, generator=gen).round().bfloat16()  # rounded: many ties
    x[1] = float("-inf")
    x[2, ::3] = float("nan")
    x[3, -1] = float("nan")
    x[4, width // 2:] = float("inf")
    x[5] = 0.0
    x[5, ::2] = -0.0
    x[6, width // 3] = 3e38
    for logits in (x, torch.cat([x, x], dim=1)[:, width // 2:width // 2 + width]):  # dense and strided rows
        got = CPP.argmax(logits)
        assert got.dtype == torch.int64 and torch.equal(got, REF.argmax(logits))
        assert torch.equal(got, logits.max(dim=-1).indices)


def test_argmax_leaves_other_tensors_to_torch():
    x = torch.randn(3, 50)
    assert torch.equal(CPP.argmax(x), x.max(dim=-1).indices)  # float32
    t = torch.randn(50, 3).bfloat16().t()  # columns not dense
    assert torch.equal(CPP.argmax(t), t.max(dim=-1).indices)
    with pytest.raises(RuntimeError, match="dense rows"):
        CPP._ext.argmax_bf16(t)
    with pytest.raises(RuntimeError, match="1 to"):
        CPP._ext.argmax_bf16(torch.zeros(2, 0, dtype=torch.bfloat16))


def test_bad_shapes_raise():
    with pytest.raises(RuntimeError, match="contiguous"):
        CPP.rms_norm(torch.zeros(4, 8).t(), torch.ones(4), EPS)
    with pytest.raises(RuntimeError, match="weight must match"):
        CPP.rms_norm(torch.zeros(4, 8), torch.ones(5), EPS)
    with pytest.raises(RuntimeError, match="even"):
        CPP.silu_and_mul(torch.zeros(2, 7))


def test_selection():
    assert get_layer_ops("auto").name == "cpp"
    assert get_layer_ops("torch").name == "torch"
    with pytest.raises(ValueError, match="unknown layer ops"):
        get_layer_ops("nope")


@needs_gemv
@pytest.mark.parametrize("bias", [False, True])
@needs_onednn_bf16
def test_prepacked_linear(bias):
    """Past the GEMV's rows a prepacked weight's linear is `F.linear`'s, bit for bit (at these shapes also
    with its rows padded, `test_onednn_rows_are_padded_to_a_bucket`); up to them the GEMV
    reads the VNNI copy where the weight's rows are a multiple of 16, else the plain weight; weights that
    were not packed take the old path."""
    ops = CppLayerOps(gemv_max_rows=8, vnni_max_rows=8)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(208, 96, generator=gen).to(torch.bfloat16)
    odd = torch.randn(200, 96, generator=gen).to(torch.bfloat16)  # no VNNI copy
    b = torch.randn(208, generator=gen).to(torch.bfloat16) if bias else None
    other = torch.randn(64, 96, generator=gen).to(torch.bfloat16)
    # duplicates and float32 are skipped; w gets two copies, odd one
    assert ops.prepack([w, w, odd, torch.randn(4, 4)]) == 2 * w.nbytes + odd.nbytes
    assert ops._packed.keys() == {id(w), id(odd)} and ops._vnni.keys() == {id(w)}
    plain = CppLayerOps(gemv_max_rows=8, vnni_max_rows=8)
    for rows in (9, 40, 513):
        x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
        assert torch.equal(ops.linear(x, w, b), torch.nn.functional.linear(x, w, b))
        assert torch.equal(ops.linear(x, odd), torch.nn.functional.linear(x, odd))
        assert torch.equal(ops.linear(x, other), torch.nn.functional.linear(x, other))
    for rows in (1, 5, 8):
        x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
        vnni = ops._ext.pack_vnni_bf16(w)
        assert torch.equal(ops.linear(x, w, b), ops._gemv(x, vnni, b))
        assert torch.equal(ops.linear(x, odd), plain.linear(x, odd))
    assert ops.prepack([]) == 0 and CppLayerOps().prepack([torch.randn(8, 8)]) == 0


@needs_onednn_bf16
def test_onednn_rows_are_padded_to_a_bucket(monkeypatch):
    """oneDNN compiles a primitive for each row count it meets, so over a prepacked copy the rows go in padded
    with zeros to a multiple of `onednn_row_bucket`, and the caller gets its own rows of that call's output;
    the compiled decode stack's `linear_onednn` pads the same way, to the same bits."""
    from kernels.layer_ops import linear_packed

    ops = CppLayerOps(gemv_max_rows=8, vnni_max_rows=8, amx_max_rows=0)
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(192, 576, generator=gen).to(torch.bfloat16)
    b = torch.randn(192, generator=gen).to(torch.bfloat16)
    ops.prepack([w])
    packed = ops._packed[id(w)][1]
    real, calls = torch.ops.mkldnn._linear_pointwise, []
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    for rows, padded in ((9, 32), (32, 32), (40, 64), (513, 544)):
        x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
        calls.clear()
        y = ops.linear(x, w, b)
        assert calls == [padded] and y.shape == (rows, 192) and y.is_contiguous()
        full = torch.cat([x, torch.zeros(padded - rows, 576, dtype=x.dtype)])
        assert torch.equal(y, real(full, packed, b, "none", [], "")[:rows])
        assert torch.equal(ops._ext.linear_onednn(x, packed, b, ops.onednn_row_bucket), y)
        assert torch.equal(linear_packed(x, packed, b), real(x, packed, b, "none", [], ""))  # bucket 1: as called
    with pytest.raises(ValueError, match="row_bucket"):
        linear_packed(x, packed, b, 0)
    with pytest.raises(RuntimeError, match="row_bucket"):
        ops._ext.linear_onednn(x, packed, b, 0)


@needs_gemv
@needs_onednn_bf16
def test_prepacked_copies_are_used():
    """The copies, not the plain weight, are what the steps read: zeroing the plain weight after packing
    leaves both a large and a small step's output as they were."""
    ops = CppLayerOps(gemv_max_rows=4, vnni_max_rows=4)
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(48, 32, generator=gen).to(torch.bfloat16)
    x = torch.randn(20, 32, generator=gen).to(torch.bfloat16)
    want, want_small = torch.nn.functional.linear(x, w), ops.linear(x[:4], w)
    ops.prepack([w])
    w.zero_()
    assert torch.equal(ops.linear(x, w), want)
    assert torch.equal(ops.linear(x[:4], w), want_small) and want_small.any()


@pytest.mark.parametrize("amx", [False, True])
def test_row_limits_default_to_the_cpu(monkeypatch, amx):
    """Where oneDNN has AMX tiles, its packed copy takes over from the GEMV at a few rows; elsewhere the
    GEMV keeps its AVX512-BF16 limits. Limits given explicitly win."""
    from kernels import layer_ops

    monkeypatch.setattr(layer_ops, "has_amx_bf16", lambda: amx)
    ops = CppLayerOps()
    want = ((layer_ops.AMX_GEMV_MAX_ROWS, layer_ops.AMX_VNNI_MAX_ROWS) if amx
            else (layer_ops.GEMV_MAX_ROWS, layer_ops.VNNI_MAX_ROWS))
    assert (ops.gemv_max_rows, ops.vnni_max_rows) == want
    assert want[1] < 16 if amx else want[1] >= 128
    given = CppLayerOps(gemv_max_rows=4, vnni_max_rows=12)
    assert (given.gemv_max_rows, given.vnni_max_rows) == (4, 12)


def test_amx_check_reads_the_cpu_flags():
    """torch's AMX check agrees with the kernel's view of the CPU (`/proc/cpuinfo`'s amx_bf16 flag)."""
    from kernels.layer_ops import has_amx_bf16

    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    assert has_amx_bf16() == (" amx_bf16" in flags)


@needs_gemv
@needs_onednn_bf16
def test_vnni_copies_take_rows_up_to_their_own_limit():
    """With VNNI copies the GEMV takes up to `vnni_max_rows` rows (oneDNN's copy above), and so does the
    compiled decode stack; weights without a VNNI copy keep the row-major GEMV's limit."""
    ops = CppLayerOps(gemv_max_rows=4, vnni_max_rows=12)
    gen = torch.Generator().manual_seed(5)
    w, odd = (torch.randn(n, 32, generator=gen).to(torch.bfloat16) for n in (48, 40))
    assert ops.decode_max_rows == 4
    ops.prepack([w, odd])
    assert ops.decode_max_rows == 12
    vnni = ops._ext.pack_vnni_bf16(w)
    for rows in (3, 12, 13):
        x = torch.randn(rows, 32, generator=gen).to(torch.bfloat16)
        want = ops._gemv(x, vnni) if rows <= 12 else torch.nn.functional.linear(x, w)
        assert torch.equal(ops.linear(x, w), want)
        assert torch.equal(ops.linear(x, odd), ops._gemv(x, odd) if rows <= 4 else torch.nn.functional.linear(x, odd))


def test_no_copies_where_onednn_has_no_bfloat16_path(monkeypatch):
    """On a CPU where oneDNN refuses bfloat16 (AVX2 only: its reorder raises), nothing is packable: `prepack`
    makes no copy and returns 0, the automatic choice does not pack, and the linear layers run as before."""
    from kernels import layer_ops
    from workers.model_setup import should_prepack

    monkeypatch.setattr(layer_ops, "onednn_bf16", lambda: False)
    ops = CppLayerOps(gemv_max_rows=4, vnni_max_rows=12)
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(48, 32, generator=gen).to(torch.bfloat16)
    assert not layer_ops.packable(w)
    assert ops.prepack([w]) == 0 and not ops._packed and not ops._vnni
    assert not should_prepack(None, [w], memory_bytes=2**40, available_bytes=2**40)
    for rows in (3, 40):
        x = torch.randn(rows, 32, generator=gen).to(torch.bfloat16)
        want = ops._gemv(x, w) if ops._gemv is not None and rows <= 4 else torch.nn.functional.linear(x, w)
        assert torch.equal(ops.linear(x, w), want)
