"""A stand-in for the `flashinfer` package's batch attention wrappers (0.2 and later), for the CPU tests of
`kernels/flashinfer_attention.py`: FlashInfer does not install here (no CUDA). It follows the documented
contract, not the kernels: `plan` takes the step's pages as int32 CSR arrays (`indptr`, `indices`, keys in
each last page) with the host arrays on the host, and in CUDA-graph mode copies them into the fixed buffers
given at construction, refusing another batch size; `run` reads what the last `plan` left (a graph's
buffers: so a replay without a fresh plan attends stale pages, as on a GPU) and checks the query and caches
against the plan (heads, page size, dtypes; NHD pages). Decode attends each sequence's one query to all its
keys; prefill's causal mask ends at each sequence's last key. Computed in float32, which it takes too."""

from __future__ import annotations

from types import ModuleType

import torch


def _int32(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.dtype == torch.int32 and t.dim() == 1, (t.dtype, t.shape)


class _Wrapper:
    kind = ""

    def __init__(self, module, workspace: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 **buffers) -> None:
        assert workspace.dtype == torch.uint8 and kv_layout == "NHD"
        self.module = module
        self.graph = use_cuda_graph
        self.buffers = buffers
        self.planned: dict | None = None
        module.wrappers.append(self)

    def _keep(self, **arrays) -> dict:
        """The plan's device arrays: copies into the fixed buffers in graph mode, else the tensors given."""
        if not self.graph:
            return arrays
        fixed = {}
        for name, value in arrays.items():
            buf = self.buffers[name]
            if name in ("indptr", "last_page_len") and value.shape[0] != buf.shape[0]:
                raise ValueError(f"batch size fixed in cudagraph mode: {buf.shape[0]}, got {value.shape[0]}")
            buf[:value.shape[0]].copy_(value)
            fixed[name] = buf
        return fixed

    def _attend(self, q, kv, qo_indptr, causal: bool) -> torch.Tensor:
        p = self.planned
        assert p is not None, "run before plan"
        k, v = kv
        assert q.dtype == p["q_dtype"] and k.dtype == v.dtype == p["kv_dtype"], (q.dtype, k.dtype, p)
        assert q.shape[1:] == (p["heads"], p["head_dim"]) and k.shape[1:] == (p["page_size"], p["kv_heads"],
                                                                            p["head_dim"]) and k.shape == v.shape
        indptr, indices, last = p["indptr"], p["indices"], p["last_page_len"]
        group = p["heads"] // p["kv_heads"]
        out = torch.empty_like(q)
        for i in range(last.shape[0]):
            pages = indices[indptr[i]:indptr[i + 1]].long()
            n = (pages.shape[0] - 1) * p["page_size"] + int(last[i])
            if self.module.wrong_decode and self.kind == "decode":
                n = max(n - 1, 1)  # a broken decode kernel: each sequence's last key left out
            assert 1 <= int(last[i]) <= p["page_size"]
            keys = k[pages].reshape(-1, p["kv_heads"], p["head_dim"])[:n].float().repeat_interleave(group, 1)
            values = v[pages].reshape(-1, p["kv_heads"], p["head_dim"])[:n].float().repeat_interleave(group, 1)
            start, end = int(qo_indptr[i]), int(qo_indptr[i + 1])
            s = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * p["sm_scale"]
            if causal and not self.module.wrong:
                visible = torch.arange(n)[None, :] <= (n - (end - start) + torch.arange(end - start))[:, None]
                s = s.masked_fill(~visible, float("-inf"))
            out[start:end] = torch.einsum("hqk,khd->qhd", s.softmax(-1), values).to(q.dtype)
        return out


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    kind = "decode"

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
        if use_cuda_graph:
            assert paged_kv_indptr_buffer.shape[0] == paged_kv_last_page_len_buffer.shape[0] + 1
        super().__init__(self.module, float_workspace_buffer, kv_layout, use_cuda_graph,
                         indptr=paged_kv_indptr_buffer, indices=paged_kv_indices_buffer,
                         last_page_len=paged_kv_last_page_len_buffer)
        self.tensor_cores = use_tensor_cores

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             pos_encoding_mode="NONE", q_data_type="float16", kv_data_type=None, sm_scale=None, **unused):
        _int32(indptr, indices, last_page_len)
        assert unused.get("non_blocking") is True  # the backend never lets a plan wait for the step in flight
        assert indptr.device.type == last_page_len.device.type == "cpu" and pos_encoding_mode == "NONE"
        assert indptr.shape[0] == last_page_len.shape[0] + 1 and int(indptr[-1]) == indices.shape[0]
        self.planned = dict(self._keep(indptr=indptr, indices=indices, last_page_len=last_page_len),
                            heads=num_qo_heads, kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                            q_dtype=q_data_type, kv_dtype=kv_data_type or q_data_type,
                            sm_scale=sm_scale if sm_scale is not None else head_dim ** -0.5)
        self.module.plans.append((self.kind, last_page_len.shape[0], self.graph))

    def run(self, q, paged_kv_cache, *args, **kwargs):
        batch = self.planned["last_page_len"].shape[0]
        assert q.shape[0] == batch, "one query per planned sequence"
        return self._attend(q, paged_kv_cache, torch.arange(batch + 1), causal=False)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    kind = "prefill"

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, **buffers):
        assert not use_cuda_graph, "the backend captures decode steps only"
        super().__init__(self.module, float_workspace_buffer, kv_layout, use_cuda_graph)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False,
             pos_encoding_mode="NONE", sm_scale=None, q_data_type="float16", kv_data_type=None, **unused):
        _int32(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        assert unused.get("non_blocking") is True
        assert qo_indptr.device.type == paged_kv_indptr.device.type == "cpu" and pos_encoding_mode == "NONE"
        assert qo_indptr.shape == paged_kv_indptr.shape and int(paged_kv_indptr[-1]) == paged_kv_indices.shape[0]
        self.planned = dict(indptr=paged_kv_indptr, indices=paged_kv_indices, last_page_len=paged_kv_last_page_len,
                            qo_indptr=qo_indptr, causal=causal, heads=num_qo_heads, kv_heads=num_kv_heads,
                            head_dim=head_dim_qk, page_size=page_size, q_dtype=q_data_type,
                            kv_dtype=kv_data_type or q_data_type,
                            sm_scale=sm_scale if sm_scale is not None else head_dim_qk ** -0.5)
        self.module.plans.append((self.kind, paged_kv_last_page_len.shape[0], False))

    def run(self, q, paged_kv_cache, *args, **kwargs):
        p = self.planned
        assert q.shape[0] == int(p["qo_indptr"][-1])
        return self._attend(q, paged_kv_cache, p["qo_indptr"], p["causal"])


def stand_in(wrong: bool = False, old_api: bool = False, wrong_decode: bool = False) -> ModuleType:
    """A `flashinfer` module; `wrong`: its prefill ignores the causal mask (a broken build); `wrong_decode`: its
    decode leaves out each sequence's last key; `old_api`: wrappers with `begin_forward` / `forward` only
    (before 0.2)."""
    module = ModuleType("flashinfer")
    module.wrong, module.wrong_decode, module.plans, module.wrappers = wrong, wrong_decode, [], []
    for base in (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper):
        if old_api:
            cls = type(base.__name__, (), {"begin_forward": base.plan, "forward": base.run})
        else:
            cls = type(base.__name__, (base,), {"module": module})
        setattr(module, base.__name__, cls)
    return module
