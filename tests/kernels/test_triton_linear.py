"""The fused norm-and-matmul kernels (`kernels/triton_linear.py`) against the torch layer ops they replace, on
a GPU where there is one, else in Triton's interpreter: the residual add, RMSNorm and a projection (with and
without a bias, for the first layer without a residual), and the gated MLP input (gate/up with
SiLU-and-multiply); float32 and bfloat16; row counts that fill no tile; the launch configs; when
`TritonLayerOps` takes the fused path and when it keeps the separate kernels."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("no GPU and TRITON_INTERPRET is not 1 (tests/conftest.py sets it)", allow_module_level=True)

from kernels import triton_linear  # noqa: E402
from kernels.layer_ops import TorchLayerOps  # noqa: E402
from kernels.triton_layer_ops import TritonLayerOps  # noqa: E402
from kernels.triton_linear import LinearConfig, norm_linear  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
# float32: sums in another order; bfloat16: the matmul's output can land a rounding step (or, through SiLU
# and the product, a few) from cuBLAS's / oneDNN's, and the norm's scale one step from the unfused kernel's
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=0.13, rtol=2e-2)}
GATED_TOLERANCE = {torch.float32: dict(atol=4e-5, rtol=1e-5), torch.bfloat16: dict(atol=0.5, rtol=4e-2)}
torch_ops, triton_ops = TorchLayerOps(), TritonLayerOps()


@pytest.fixture(autouse=True)
def fused_by_default(monkeypatch):
    """The layer ops run the fused kernels (`NORM_LINEAR_CONFIG`: off by default, as the GPU check's linear
    sweep applies them where they win) unless a test says otherwise."""
    monkeypatch.setattr(triton_linear, "NORM_LINEAR_CONFIG", LinearConfig())


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _inputs(rows: int, k: int, n: int, dtype: torch.dtype, seed: int = 0) -> dict:
    return {"x": _randn(rows, k, dtype=dtype, seed=seed, scale=3.0),
            "residual": _randn(rows, k, dtype=dtype, seed=seed + 1),
            "norm_weight": _randn(k, dtype=dtype, seed=seed + 2, scale=0.1) + 1,
            "weight": _randn(n, k, dtype=dtype, seed=seed + 3, scale=k ** -0.5),
            "bias": _randn(n, dtype=dtype, seed=seed + 4)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 17, 40])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_norm_linear_matches_the_torch_ops(dtype, rows, residual, bias):
    """A hidden size and an output width that are no multiple of the tiles (96 -> 80), rows that fill none."""
    a = _inputs(rows, 96, 80, dtype, seed=rows)
    res, b = (a["residual"] if residual else None), (a["bias"] if bias else None)
    x_before = a["x"].clone()
    total, y = triton_linear.norm_linear(a["x"], res, a["norm_weight"], 1e-5, a["weight"], b)
    want_total, want_y = torch_ops.norm_linear(x_before.clone(), res, a["norm_weight"], 1e-5, a["weight"], b)
    assert y.shape == (rows, 80) and y.dtype == dtype and total.shape == (rows, 96)
    assert torch.equal(a["x"], x_before)  # the stream is not written in place
    if residual:
        torch.testing.assert_close(total, want_total, **({} if dtype == torch.float32 else TOLERANCE[dtype]))
    else:
        assert total is a["x"]
    torch.testing.assert_close(y, want_y, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 33])
def test_gated_norm_linear_matches_the_torch_ops(dtype, rows):
    a = _inputs(rows, 96, 2 * 72, dtype, seed=10 + rows)
    total, act = triton_linear.norm_linear(a["x"], a["residual"], a["norm_weight"], 1e-5, a["weight"], gated=True)
    want_total, want_act = torch_ops.norm_gate_up(a["x"].clone(), a["residual"], a["norm_weight"], 1e-5, a["weight"])
    assert act.shape == (rows, 72)
    torch.testing.assert_close(total, want_total, **({} if dtype == torch.float32 else TOLERANCE[dtype]))
    torch.testing.assert_close(act, want_act, **GATED_TOLERANCE[dtype])


def test_smollm2_shapes_in_bfloat16():
    """SmolLM2-135M's layer: hidden 576, qkv 960 wide, gate/up 2 x 1536, at a decode batch of 24 rows."""
    a = _inputs(24, 576, 960, torch.bfloat16, seed=3)
    _, y = triton_ops.norm_linear(a["x"], a["residual"], a["norm_weight"], 1e-5, a["weight"])
    _, want = torch_ops.norm_linear(a["x"].clone(), a["residual"], a["norm_weight"], 1e-5, a["weight"])
    torch.testing.assert_close(y, want, **TOLERANCE[torch.bfloat16])
    gate_up = _randn(2 * 1536, 576, dtype=torch.bfloat16, seed=4, scale=576 ** -0.5)
    _, act = triton_ops.norm_gate_up(a["x"], a["residual"], a["norm_weight"], 1e-5, gate_up)
    _, want_act = torch_ops.norm_gate_up(a["x"].clone(), a["residual"], a["norm_weight"], 1e-5, gate_up)
    torch.testing.assert_close(act, want_act, **GATED_TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("config", [LinearConfig(block_m=16, block_n=16, block_k=16), LinearConfig(block_m=64, block_n=32,
                                                                                                  block_k=128, num_warps=8, num_stages=2),
                                    LinearConfig(pdl=True)])
def test_launch_configs_give_the_default_configs_result(config):
    a = _inputs(37, 96, 80, torch.float32, seed=5)
    want = triton_linear.norm_linear(a["x"], a["residual"], a["norm_weight"], 1e-5, a["weight"], a["bias"])[1]
    got = triton_linear.norm_linear(a["x"], a["residual"], a["norm_weight"], 1e-5, a["weight"], a["bias"],
                                    config=config)[1]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_rows_per_program_and_config_checks():
    config = LinearConfig(block_m=64)
    assert [config.rows_per_program(r) for r in (0, 1, 16, 17, 40, 64, 65, 512)] == [16, 16, 16, 32, 64, 64, 64, 64]
    for bad in (dict(block_m=8), dict(block_n=48), dict(num_warps=3), dict(num_stages=0), dict(max_rows=-1)):
        with pytest.raises(ValueError):
            LinearConfig(**bad)


def test_bad_inputs_are_refused():
    a = _inputs(4, 96, 80, torch.float32)
    with pytest.raises(ValueError, match="gated"):
        triton_linear.norm_linear(a["x"], a["residual"], a["norm_weight"], 1e-5, a["weight"], a["bias"], gated=True)
    with pytest.raises(ValueError, match="weight"):
        triton_linear.norm_linear(a["x"], None, a["norm_weight"], 1e-5, a["weight"][:, :64])
    with pytest.raises(ValueError, match="unit stride"):
        triton_linear.norm_linear(a["x"].t(), None, a["norm_weight"], 1e-5, a["weight"])


def test_triton_ops_fuse_up_to_max_rows_and_not_without_a_config(monkeypatch):
    """Steps of up to `max_rows` rows run the fused kernel; larger ones (prefill chunks) and every step under
    `NORM_LINEAR_CONFIG = None` run the norm kernel and the matmul apart, with the same result."""
    calls: list[int] = []
    fused = triton_linear.norm_linear

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0])
        return fused(x, *args, **kwargs)

    monkeypatch.setattr(triton_linear, "norm_linear", counted)
    monkeypatch.setattr(triton_linear, "NORM_LINEAR_CONFIG", LinearConfig(max_rows=8))
    results = {}
    for rows in (8, 9):
        a = _inputs(rows, 96, 80, torch.float32, seed=rows)
        results[rows] = triton_ops.norm_linear(a["x"], a["residual"], a["norm_weight"], 1e-5, a["weight"])[1]
        triton_ops.norm_gate_up(a["x"], a["residual"], a["norm_weight"], 1e-5, a["weight"])
        torch.testing.assert_close(results[rows], torch_ops.norm_linear(a["x"].clone(), a["residual"], a["norm_weight"],
                                                                        1e-5, a["weight"])[1], **TOLERANCE[torch.float32])
    assert calls == [8, 8]
    monkeypatch.setattr(triton_linear, "NORM_LINEAR_CONFIG", None)
    a = _inputs(4, 96, 80, torch.float32)
    triton_ops.norm_linear(a["x"], None, a["norm_weight"], 1e-5, a["weight"])
    assert calls == [8, 8]


def _rope_tables(head_dim: int, positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat([torch.arange(positions).float()[:, None] * inv[None]] * 2, dim=-1)
    return emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 32), (2, 1, 128)])
@pytest.mark.parametrize("rows,residual,bias", [(1, False, False), (17, True, False), (40, True, True)])
def test_project_qkv_in_one_kernel_matches_the_separate_ops(dtype, heads, rows, residual, bias):
    """`TritonPagedAttention.project_qkv` with the Triton layer ops (one kernel: add, norm, qkv, rotary, K/V
    store) against the base backend's steps with the torch ops: the stream, the queries and the caches (keys
    and values in their slots, a negative slot writing nowhere, every other slot untouched)."""
    from kernels.attention import AttentionBackend
    from kernels.triton_attention import TritonAttentionMetadata, TritonPagedAttention

    nh, kvh, d = heads
    hidden = 96
    a = _inputs(rows, hidden, (nh + 2 * kvh) * d, dtype, seed=rows + d)
    res, b = (a["residual"] if residual else None), (a["bias"] if bias else None)
    cos, sin = _rope_tables(d, 300, dtype)
    gen = torch.Generator().manual_seed(rows)
    positions = torch.randint(0, 300, (rows,), generator=gen).to(DEVICE)
    block_size, blocks = 16, 8
    slots = torch.randperm(blocks * block_size, generator=gen)[:rows]
    if rows > 1:
        slots[rows // 2] = -1  # a padded row: writes nowhere
    meta = TritonAttentionMetadata(slots.to(DEVICE), None, None, None)
    attn = TritonPagedAttention(DEVICE)
    caches = {}
    for name, backend, ops in (("fused", attn, triton_ops), ("separate", attn, torch_ops)):
        k_cache = torch.full((blocks, block_size, kvh, d), 7.0, dtype=dtype, device=DEVICE)
        v_cache = torch.full_like(k_cache, 7.0)
        project = AttentionBackend.project_qkv if name == "separate" else type(backend).project_qkv
        total, q = project(backend, a["x"].clone(), res, a["norm_weight"], 1e-5, a["weight"], b, nh, kvh,
                           (cos, sin, positions), ops, k_cache, v_cache, meta)
        caches[name] = (total, q, k_cache, v_cache)
    (total, q, k, v), (want_total, want_q, want_k, want_v) = caches["fused"], caches["separate"]
    assert q.shape == (rows, nh, d) and q.is_contiguous()
    torch.testing.assert_close(total, want_total, **({} if dtype == torch.float32 else TOLERANCE[dtype]))
    torch.testing.assert_close(q, want_q, **TOLERANCE[dtype])
    torch.testing.assert_close(k, want_k, **TOLERANCE[dtype])
    torch.testing.assert_close(v, want_v, **TOLERANCE[dtype])
    written = torch.zeros(blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    untouched = ~written.view(blocks, block_size).to(DEVICE)
    assert (k[untouched] == 7).all() and (v[untouched] == 7).all()
    assert not (k[~untouched] == 7).all()


def test_project_qkv_keeps_the_separate_kernels_where_it_cannot_fuse(monkeypatch):
    """The torch layer ops, no config, more rows than `max_rows`, or a head_dim of 16: the base backend's
    steps (the norm-and-matmul, then the rotary-and-store kernel)."""
    from kernels import triton_attention
    from kernels.triton_attention import TritonAttentionMetadata, TritonPagedAttention

    calls = []
    monkeypatch.setattr(triton_attention, "norm_qkv_rope_store", lambda *args, **kw: calls.append(1))
    attn = TritonPagedAttention(DEVICE)

    def project(ops, rows=4, d=32, config=LinearConfig()):
        monkeypatch.setattr(triton_linear, "NORM_LINEAR_CONFIG", config)
        a = _inputs(rows, 64, 4 * d, torch.float32)
        cos, sin = _rope_tables(d, 16, torch.float32)
        cache = torch.zeros(4, 16, 1, d, device=DEVICE)
        meta = TritonAttentionMetadata(torch.arange(rows, device=DEVICE), None, None, None)
        attn.project_qkv(a["x"], None, a["norm_weight"], 1e-5, a["weight"], None, 2, 1,
                         (cos, sin, torch.zeros(rows, dtype=torch.long, device=DEVICE)), ops, cache, cache.clone(), meta)

    project(triton_ops)
    assert calls == [1]
    project(torch_ops)
    project(triton_ops, config=None)
    project(triton_ops, config=LinearConfig(max_rows=3))
    project(triton_ops, d=16)
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 17, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_plain_linear_matches_f_linear(dtype, rows, bias):
    a = _inputs(rows, 96, 80, dtype, seed=20 + rows)
    b = a["bias"] if bias else None
    got = triton_linear.linear(a["x"], a["weight"], b)
    torch.testing.assert_close(got, torch.nn.functional.linear(a["x"], a["weight"], b), **TOLERANCE[dtype])


def test_triton_ops_linear_takes_the_kernel_only_under_plain_matmuls(monkeypatch):
    """cuBLAS's matmul unless the config says `plain_matmuls`; then the kernel for steps it takes, but not for
    a matmul wider than `PLAIN_MAX_OUT` (the LM head)."""
    calls: list[int] = []
    kernel = triton_linear.linear
    monkeypatch.setattr(triton_linear, "linear", lambda x, w, *a, **k: calls.append(w.shape[0]) or kernel(x, w, *a, **k))
    monkeypatch.setattr(triton_linear, "PLAIN_MAX_OUT", 64)
    x = _randn(5, 32, dtype=torch.float32, seed=1)
    narrow, wide = _randn(64, 32, dtype=torch.float32, seed=2), _randn(80, 32, dtype=torch.float32, seed=3)
    for config in (LinearConfig(), None, LinearConfig(plain_matmuls=True), LinearConfig(plain_matmuls=True, max_rows=4)):
        monkeypatch.setattr(triton_linear, "NORM_LINEAR_CONFIG", config)
        for w in (narrow, wide):
            torch.testing.assert_close(triton_ops.linear(x, w), torch.nn.functional.linear(x, w), **TOLERANCE[torch.float32])
    assert calls == [64]


class _SharedMemoryKernel:
    """A stand-in kernel whose launch needs more shared memory than the GPU has at more than `fits` stages, as
    Triton's `OutOfResources` says before launching anything; records each launch's stages."""

    def __init__(self, fits: int) -> None:
        self.fits, self.launches = fits, []

    def __getitem__(self, grid):
        def launch(*args, num_stages, **kwargs):
            from triton.runtime.errors import OutOfResources

            self.launches.append(num_stages)
            if num_stages > self.fits:
                raise OutOfResources(40000 * num_stages, 101376, "shared memory")
        return launch


def test_launch_fitting_takes_fewer_stages_where_shared_memory_is_short():
    kernel = _SharedMemoryKernel(fits=2)
    x = torch.zeros(2, dtype=torch.float32)
    triton_linear.launch_fitting(kernel, (1,), x, 7, num_stages=3, num_warps=4, BLOCK=16)
    assert kernel.launches == [3, 2]
    triton_linear.launch_fitting(kernel, (1,), x, 7, num_stages=3, num_warps=4, BLOCK=16)  # remembered
    assert kernel.launches == [3, 2, 2]
    # another dtype is another variant: it tries three stages first too
    triton_linear.launch_fitting(kernel, (1,), x.bfloat16(), 7, num_stages=3, num_warps=4, BLOCK=16)
    assert kernel.launches == [3, 2, 2, 3, 2]
    none_fit = _SharedMemoryKernel(fits=0)
    with pytest.raises(Exception, match="shared memory"):
        triton_linear.launch_fitting(none_fit, (1,), x, num_stages=2, num_warps=4)
    assert none_fit.launches == [2, 1]


def test_the_qkv_kernel_with_programmatic_dependent_launch_gives_the_same_bits():
    """`norm_qkv_rope_store` under a config with `pdl` (launched so on a GPU from sm_90, after a kernel that
    wrote its input; ignored here): the same stream, queries and caches as without, to the bit."""
    from kernels.triton_kv_write import norm_qkv_rope_store

    nh, kvh, d, rows = 9, 3, 64, 40
    got = []
    for config in (LinearConfig(), LinearConfig(pdl=True)):
        a = _inputs(rows, 96, (nh + 2 * kvh) * d, torch.bfloat16, seed=11)
        x = a["x"] * 1.5  # written by a kernel just before, as a layer's input is
        cos, sin = _rope_tables(d, 300, torch.bfloat16)
        positions = torch.arange(rows, device=DEVICE) * 7
        k_cache = torch.zeros(8, 16, kvh, d, dtype=torch.bfloat16, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.arange(rows, device=DEVICE) * 3
        total, q = norm_qkv_rope_store(x, a["residual"], a["norm_weight"], 1e-5, a["weight"], None, nh, kvh, cos, sin,
                                       positions, k_cache, v_cache, slots, config)
        got.append((total, q, k_cache, v_cache))
    for want, have in zip(*got):
        assert torch.equal(want, have)


def test_programmatic_dependent_launch_only_where_the_device_has_it(monkeypatch):
    """`pdl_launch`: off unless asked; off under the interpreter, on the CPU and on CUDA before sm_90; on for
    sm_90 and the meta device (the ahead-of-time compile records it there)."""
    from kernels.triton_linear import pdl_launch

    monkeypatch.setattr(triton_linear, "_CAPABILITY", {})
    assert pdl_launch(False, torch.device("meta")) == {"PDL": False}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl_launch(True, torch.device("meta")) == {"PDL": False}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert pdl_launch(True, torch.device("cpu")) == {"PDL": False}
    assert pdl_launch(True, torch.device("meta")) == {"PDL": True, "launch_pdl": True}
    for major, want in ((8, {"PDL": False}), (9, {"PDL": True, "launch_pdl": True})):
        triton_linear._CAPABILITY.clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, major=major: (major, 0))
        assert pdl_launch(True, torch.device("cuda", 0)) == want
