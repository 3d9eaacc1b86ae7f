"""CUDA graphs for decode-only steps, captured once per batch size of a ladder (as vLLM and nano-vllm do).

A decode step's work depends only on its batch size, so each ladder size is captured over static buffers and
a step of `n` decodes replays the smallest captured size `>= n`: its inputs are copied into the buffers with
one host-to-device copy (one pinned host buffer laid out like the device buffer), and the padding rows write
nowhere (slot -1, which the Triton store kernel skips) and attend one key of block 0. Prefill and mixed steps
run eagerly. The capture function is a parameter so that the ladder and padding logic run on the CPU in tests
(`eager_capture`), where replaying means calling the step again."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.attention import CommonAttentionMetadata

Capture = Callable[[Callable[[], torch.Tensor], object], tuple[Callable[[], None], torch.Tensor]]


def batch_ladder(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every multiple of 16 up to (and including) `max_batch`."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


def cuda_capture(fn: Callable[[], torch.Tensor], pool) -> tuple[Callable[[], None], torch.Tensor]:
    """Warm `fn` up on a side stream, then capture it; returns the graph's replay and its output tensor."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph.replay, out


def eager_capture(fn: Callable[[], torch.Tensor], pool) -> tuple[Callable[[], None], torch.Tensor]:
    """A stand-in for `cuda_capture` on the CPU: replaying runs `fn` again into the same output tensor."""
    out = fn()

    def replay() -> None:
        with torch.inference_mode():  # the model's output is an inference tensor
            out.copy_(fn())

    return replay, out


@dataclass(slots=True)
class _Buffers:
    """Views into one int64 device buffer, so one copy fills every input of a step."""

    flat: torch.Tensor
    input_ids: torch.Tensor  # [max_batch]
    positions: torch.Tensor  # [max_batch]
    slot_mapping: torch.Tensor  # [max_batch]
    seq_lens: torch.Tensor  # [max_batch]
    query_start_loc: torch.Tensor  # [max_batch + 1]
    block_tables: torch.Tensor  # [max_batch, max_blocks], the buffer's last view

    @classmethod
    def make(cls, max_batch: int, max_blocks: int, device: torch.device, pin: bool) -> _Buffers:
        b = max_batch
        # each view from an even element, a 16-byte boundary: Triton's JIT specializes a kernel on its pointers'
        # alignment, and the block tables at element 5 * b + 1 (odd for even b, 256 included) gave the graphs'
        # attention variants that nothing compiled ahead (`workers/kernel_variants.py`)
        seg = (b + 2) // 2 * 2  # at least b + 1 (query_start_loc's length), even
        at = 5 * seg
        flat = torch.zeros(at + b * max_blocks, dtype=torch.long, device=device, pin_memory=pin)
        return cls(flat, flat[:b], flat[seg:seg + b], flat[2 * seg:2 * seg + b], flat[3 * seg:3 * seg + b],
                   flat[4 * seg:4 * seg + b + 1], flat[at:].view(b, max_blocks))


class DecodeGraphs:
    """`forward(input_ids, positions, common, logits_indices) -> logits` is the model step; `meta_for` builds
    the attention backend's metadata over the static buffers (its tensors must be views of them);
    `prepare(meta, seq_lens, block_tables)`, if given, does a size's host work before each replay and before
    its capture, given the padded step's context lengths and block tables on the host (a backend that plans
    each step there: `AttentionBackend.prepare_graph_step`)."""

    def __init__(self, forward: Callable, meta_for: Callable, max_batch: int, max_blocks: int, device: torch.device,
                 capture: Capture = cuda_capture, prepare: Callable | None = None) -> None:
        self.sizes = batch_ladder(max_batch)
        self._prepare = prepare
        self._metas: dict[int, object] = {}
        self.max_blocks = max_blocks
        self.device = device
        # two host buffers taken in turn: one is written while the copy from the other may still be queued
        # behind the step in flight (`Engine.async_scheduling`)
        self._hosts = [_Buffers.make(max_batch, max_blocks, torch.device("cpu"), pin=device.type == "cuda")
                       for _ in range(2)]
        self._host = self._hosts[0]
        self._dev = _Buffers.make(max_batch, max_blocks, device, pin=False)
        # `advance`'s new block ids (index, id pairs; up to two blocks a row), staged in pinned memory taken in
        # turn as the host buffers are
        self.max_new_blocks = 2 * max_batch
        self._new_blocks = [torch.zeros(2 * self.max_new_blocks, dtype=torch.long, pin_memory=device.type == "cuda")
                            for _ in range(2)]
        self._turn = 0
        # every row samples: the logits rows of a step of `size` are rows[:size]
        self.rows = torch.arange(max_batch, device=device)
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.copied = 0  # elements of the last step's host-to-device copy
        self.steps_advanced = 0  # steps run by `advance`
        self.blocks_advanced = 0  # block ids those steps' rows took, sent with them
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        d = self._dev
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            self._pad(0, size)
            d.flat.copy_(self._host.flat)
            meta = self._metas[size] = meta_for(d.slot_mapping[:size], d.block_tables[:size], d.seq_lens[:size],
                                                d.query_start_loc[:size + 1])
            if prepare is not None:
                prepare(meta, self._host.seq_lens[:size], self._host.block_tables[:size])

            # A captured graph reads its inputs at the addresses they had at capture, and keeps none of them
            # alive: each is a view of a buffer held here (`_dev`, `rows`), never a tensor of its own that
            # would be freed after the capture and its memory handed to another tensor.
            def step(size=size, meta=meta) -> torch.Tensor:
                return forward(d.input_ids[:size], d.positions[:size], meta, self.rows[:size])

            self._graphs[size] = capture(step, pool)

    def supports(self, common: CommonAttentionMetadata) -> bool:
        """A decode-only step that fits the ladder and the buffers' block-table width."""
        n = common.query_lens.shape[0]
        return (n <= self.sizes[-1] and common.block_tables.shape[1] <= self.max_blocks
                and int(common.query_start_loc[-1]) == n)

    def padded_size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def _pad(self, n: int, size: int) -> None:
        """Rows `n..size` of the host buffer: one query each at position 0, writing nowhere, seeing one key."""
        h = self._host
        h.input_ids[n:size] = 0
        h.positions[n:size] = 0
        h.slot_mapping[n:size] = -1
        h.seq_lens[n:size] = 1
        h.block_tables[n:size] = 0
        h.query_start_loc[n:size + 1] = torch.arange(n, size + 1)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, common: CommonAttentionMetadata,
            device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ([n, vocab]) of a decode-only step of `n` requests, by replaying the padded size's graph.
        `device_ids` (on the device) replace `input_ids` (a step queued behind the one whose sampled ids
        they are)."""
        n = input_ids.shape[0]
        size = self.padded_size(n)
        self._host = h = self._hosts[1] if self._host is self._hosts[0] else self._hosts[0]
        h.input_ids[:n] = input_ids
        h.positions[:n] = positions
        h.slot_mapping[:n] = common.slot_mapping
        h.seq_lens[:n] = common.context_lens
        width = common.block_tables.shape[1]
        h.block_tables[:n, :width] = common.block_tables
        h.block_tables[:n, width:] = 0
        h.query_start_loc[:n + 1] = common.query_start_loc
        self._pad(n, size)
        # the step's inputs and the block-table rows of its graph's size: a prefix of the buffer (all of it,
        # 1 MB at 256 rows of 512 blocks, was copied for every step, one row's included)
        self.copied = self._dev.block_tables.storage_offset() + size * self.max_blocks
        self._dev.flat[:self.copied].copy_(h.flat[:self.copied], non_blocking=True)
        if device_ids is not None:
            self._dev.input_ids[:n].copy_(device_ids)
        if self._prepare is not None:
            self._prepare(self._metas[size], h.seq_lens[:size], h.block_tables[:size])
        return self._replay(n, size)

    @property
    def advances(self) -> bool:
        """Whether `advance` may run a step (not with a backend that plans each step on the host)."""
        return self._prepare is None

    def advance(self, n: int, new_blocks: list[int], device_ids: torch.Tensor, block_size: int) -> torch.Tensor:
        """Logits of the decode step after the last one replayed, over the same `n` rows in the same order,
        each one position further, its input id from `device_ids` (the step before's sampled ids, on the
        device): the buffers are advanced on the device (positions, context lengths and slots), with no host
        tensor built and no copy but `new_blocks`, the block ids rows took since (an index into the flattened
        block tables, then a block id, for each of at most `max_new_blocks`). vLLM's multi-step scheduling
        advanced its steps on the device alike; here it saves the host a step's inputs (`build_ahead_inputs`
        and `run`'s buffers: ~0.2 ms at batch 256 on a 2-core Zen 4)."""
        d = self._dev
        if new_blocks:
            self._turn ^= 1
            staged = self._new_blocks[self._turn][:len(new_blocks)]
            staged.copy_(torch.frombuffer(array("q", new_blocks), dtype=torch.long))
            pairs = staged.to(self.device, non_blocking=True).view(-1, 2)
            d.block_tables.view(-1).index_copy_(0, pairs[:, 0], pairs[:, 1])
            self.blocks_advanced += len(new_blocks) // 2
        positions = d.positions[:n]
        positions += 1
        torch.add(positions, 1, out=d.seq_lens[:n])
        index = positions // block_size
        blocks = d.block_tables[:n].gather(1, index[:, None])[:, 0]
        torch.add(positions, blocks - index, alpha=block_size, out=d.slot_mapping[:n])
        d.input_ids[:n].copy_(device_ids)
        self.steps_advanced += 1
        return self._replay(n, self.padded_size(n))

    def _replay(self, n: int, size: int) -> torch.Tensor:
        replay, logits = self._graphs[size]
        replay()
        return logits[:n]
