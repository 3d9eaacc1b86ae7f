"""FlashInfer's paged attention as an optional CUDA attention backend (`flashinfer`, 0.2 and later: the
wrappers' `plan` / `run`). Not a dependency (its kernels are built for one torch and one CUDA, or compiled
at first use), so it is used only where it imports and passes the self-check that the FlashAttention
backends run (`kernels/flash_attention.check_package`); `auto` on CUDA tries it after them, before Triton.

FlashInfer splits a step in two: `plan`, on the host, once per step (the pages of each sequence as a CSR
array, `indptr` and `indices`, and the keys in each sequence's last page; it schedules the kernel's work and
copies that schedule to the device), then `run`, in each layer. The caches keep the engine's layout,
`[num_blocks, block_size, kv_heads, head_dim]`, FlashInfer's "NHD" pages; the K/V store, fused layer input and
metadata are the Triton backend's. Decode-only steps take a decode wrapper, other steps (prompt chunks beside
decodes) a prefill wrapper, whose causal mask ends at each sequence's last key as the engine's chunks need.

CUDA graphs: a decode step of each ladder size has its own decode wrapper over fixed buffers (FlashInfer's
`use_cuda_graph`), created at its capture; the graph records `run` only, and before each replay
`prepare_graph_step` plans the wrapper on the step's padded tables (`workers/cuda_graphs.DecodeGraphs`).

`plan` writes its schedule into a pinned host buffer of the wrapper's and copies it to the device without
waiting; with steps queued ahead (`Engine.async_scheduling`) the next plan of the same wrapper could
overwrite that buffer before the copy ran, so each wrapper's plan waits for the copies of its previous one
(an event recorded after it: already done in practice, the host being a step ahead at most). The CSR arrays
are pinned tensors of their own each step (torch's pinned allocator keeps them until their copies ran), the
page indices handed over on the device (from the host, a graph wrapper copies them synchronously)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from kernels.attention import AttentionSpec, CommonAttentionMetadata
from kernels.flash_attention import check_package
from kernels.triton_attention import TritonAttentionMetadata, TritonPagedAttention

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partial results), shared


@dataclass(slots=True)
class PagedCSR:
    """A step's pages as FlashInfer plans them: int32, `indptr` and `last_page_len` on the host, `indices` on
    the cache's device."""

    qo_indptr: torch.Tensor | None  # [num_seqs + 1], for the prefill wrapper (None for a decode-only step)
    indptr: torch.Tensor  # [num_seqs + 1]: sequence i's pages are indices[indptr[i]:indptr[i + 1]]
    indices: torch.Tensor  # [indptr[-1]]
    last_page_len: torch.Tensor  # [num_seqs]: keys in each sequence's last page, 1..block_size
    decode: bool  # one query per sequence


@dataclass(slots=True)
class FlashInferMetadata(TritonAttentionMetadata):
    """The Triton backend's metadata and the step's pages (an eager step: planned at its first layer on the
    backend's shared wrapper of its kind)."""

    csr: PagedCSR | None = None


@dataclass(slots=True)
class FlashInferGraphMetadata(TritonAttentionMetadata):
    """A captured decode size's metadata: its own decode wrapper over fixed buffers (made at its first plan)
    and the pages it was last planned on."""

    csr: PagedCSR | None = None
    wrapper: object = None  # it holds its fixed buffers
    planned: bool = False


def paged_csr(query_start_loc: torch.Tensor | None, context_lens: torch.Tensor, block_tables: torch.Tensor,
              block_size: int, device: torch.device) -> PagedCSR:
    """The pages of each sequence (`context_lens` keys through its row of `block_tables`) as FlashInfer's
    CSR arrays, from host tensors (in numpy: 38 us at batch 256 on this CPU, where torch's small ops took 102);
    `query_start_loc` None: a decode-only step (a graph's)."""
    ctx = context_lens.numpy()
    num_seqs = ctx.shape[0]
    pages = (ctx + block_size - 1) // block_size
    indptr = np.zeros(num_seqs + 1, np.int32)
    np.cumsum(pages, out=indptr[1:])
    width = int(pages.max()) if num_seqs else 0
    if width > block_tables.shape[1]:
        raise ValueError(f"block tables of {block_tables.shape[1]} blocks do not hold {width} pages")
    used = np.arange(width) < pages[:, None]
    decode = query_start_loc is None or int(query_start_loc[-1]) == num_seqs
    arrays = [indptr, block_tables.numpy()[:, :width][used].astype(np.int32),
              (ctx - (pages - 1) * block_size).astype(np.int32)]
    if not decode:  # the query offsets: the prefill wrapper's only
        arrays.append(query_start_loc.numpy().astype(np.int32))
    host = [torch.from_numpy(a) for a in arrays]
    if device.type == "cuda":  # through pinned memory, without waiting for the step in flight
        host = [t.pin_memory() for t in host]
    indptr_t, indices, last, *qo = host
    return PagedCSR(qo[0] if qo else None, indptr_t, indices.to(device, non_blocking=True), last, decode)


class FlashInferPagedAttention(TritonPagedAttention):
    """`flashinfer`'s batch decode and prefill wrappers over the paged caches (see the module docstring)."""

    name = "flashinfer"
    block_multiple = 1  # any block size
    dtypes = (torch.float16, torch.bfloat16)

    def __init__(self, device: torch.device | str = "cuda", module: ModuleType | None = None) -> None:
        """`module`: the package (default: `import flashinfer`; tests give a stand-in, on the CPU under
        Triton's interpreter)."""
        super().__init__(device)
        if module is None:
            try:
                module = importlib.import_module("flashinfer")
            except ImportError as e:  # (an ImportError still: `auto` and the GPU check tell "not installed")
                raise ImportError(f"the {self.name} attention backend needs the flashinfer-python package, 0.2 "
                                  f"or later: {e}") from e
        self.fi = module
        for cls in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"):
            if not hasattr(getattr(self.fi, cls, None), "plan"):
                raise ValueError(f"{self.name} needs the package's {cls}.plan (flashinfer 0.2 or later)")
        self._workspace: torch.Tensor | None = None
        self._eager: dict[bool, object] = {}  # decode (True) and prefill (False) wrappers of eager steps
        self._owner: dict[int, object] = {}  # id(wrapper) -> the metadata it is planned for
        self._events: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> its last plan's copies
        self._params: tuple | None = None  # (heads, kv heads, head_dim, block size, q dtype, kv dtype, scale)

    def check(self, spec: AttentionSpec) -> None:
        """Raise ValueError unless this backend serves `spec` (`check_package`)."""
        check_package(self, spec)

    def build_metadata(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        base = super().build_metadata(common)
        csr = paged_csr(common.query_start_loc, common.context_lens, common.block_tables, common.block_size,
                        self.device)
        return FlashInferMetadata(base.slot_mapping, base.block_tables, base.seq_lens, base.query_start_loc, csr)

    def graph_metadata(self, slot_mapping, block_tables, seq_lens, query_start_loc) -> FlashInferGraphMetadata:
        return FlashInferGraphMetadata(slot_mapping, block_tables, seq_lens, query_start_loc)

    def prepare_graph_step(self, meta: FlashInferGraphMetadata, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                           block_size: int) -> None:
        """Plan a captured size's wrapper on the padded step's host tables (before its replay, and before its
        capture: there, before the first step, the warm-up's first layer plans it, learning the heads and
        dtypes)."""
        meta.csr = paged_csr(None, seq_lens, block_tables, block_size, self.device)
        meta.planned = False
        if self._params is not None:
            self._plan_graph(meta)

    def forward(self, query, k_cache, v_cache, meta: TritonAttentionMetadata, scale: float) -> torch.Tensor:
        params = (query.shape[1], k_cache.shape[2], query.shape[2], k_cache.shape[1], query.dtype, k_cache.dtype,
                  scale)
        if self._params != params:
            if self._params is not None:
                raise ValueError(f"{self.name}: attention planned for (heads, kv heads, head_dim, block size, "
                                 f"dtypes, scale) {self._params}, called with {params}")
            self._params = params
        if isinstance(meta, FlashInferGraphMetadata):
            if not meta.planned:  # the capture's warm-up (eager); the capture and replays find it planned
                self._plan_graph(meta)
            wrapper = meta.wrapper
        else:
            if not isinstance(meta, FlashInferMetadata):
                raise ValueError(f"{self.name} attention needs its own metadata, got {type(meta).__name__}")
            wrapper = self._eager_wrapper(meta.csr.decode)
            if self._owner.get(id(wrapper)) is not meta:
                self._plan(wrapper, meta.csr, meta)
        return wrapper.run(query, (k_cache, v_cache))

    def _new_wrapper(self, decode: bool, graph_batch: int = 0, graph_pages: int = 0):
        if self._workspace is None:
            size = WORKSPACE_BYTES if self.device.type == "cuda" else 1 << 16  # off CUDA: a stand-in's
            self._workspace = torch.zeros(size, dtype=torch.uint8, device=self.device)
        if not decode:
            return self.fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        heads, kv_heads = self._params[:2]
        tensor_cores = heads // kv_heads > 4  # vLLM's choice: the prefill kernels for wide query groups
        if not graph_batch:
            return self.fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=tensor_cores)
        def buffer(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=self.device)

        return self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=buffer(graph_batch + 1), paged_kv_indices_buffer=buffer(graph_pages),
            paged_kv_last_page_len_buffer=buffer(graph_batch))

    def _eager_wrapper(self, decode: bool):
        wrapper = self._eager.get(decode)
        if wrapper is None:
            wrapper = self._eager[decode] = self._new_wrapper(decode)
        return wrapper

    def _plan_graph(self, meta: FlashInferGraphMetadata) -> None:
        if meta.wrapper is None:
            batch, width = meta.block_tables.shape
            meta.wrapper = self._new_wrapper(True, batch, batch * width)
        self._plan(meta.wrapper, meta.csr, meta)
        meta.planned = True

    def _plan(self, wrapper, csr: PagedCSR, owner) -> None:
        """Plan `wrapper` for `csr`'s step (after the copies of its previous plan ran: see the module
        docstring)."""
        heads, kv_heads, head_dim, block_size, q_dtype, kv_dtype, scale = self._params
        event = self._events.get(id(wrapper))
        if event is None and self.device.type == "cuda":
            event = self._events[id(wrapper)] = torch.cuda.Event()
        if event is not None:
            event.synchronize()  # (at once if never recorded)
        # non_blocking: the copies to the device queue behind the step in flight (early releases default
        # to waiting for it)
        common = dict(q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=scale, non_blocking=True)
        if not isinstance(wrapper, self.fi.BatchPrefillWithPagedKVCacheWrapper):
            wrapper.plan(csr.indptr, csr.indices, csr.last_page_len, heads, kv_heads, head_dim, block_size,
                         pos_encoding_mode="NONE", **common)
        else:
            wrapper.plan(csr.qo_indptr, csr.indptr, csr.indices, csr.last_page_len, heads, kv_heads, head_dim,
                         block_size, causal=True, pos_encoding_mode="NONE", **common)
        if event is not None:
            event.record()
        self._owner[id(wrapper)] = owner
