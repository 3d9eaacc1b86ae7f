"""What one run measures and at what size: the full check on a GPU, or a tiny dry run on the CPU that
exercises every path (Triton in its interpreter, graphs replayed eagerly)."""

from __future__ import annotations

from dataclasses import dataclass

# (new tokens this step, context length including them): decodes and chunks mixed, off block boundaries
KERNEL_BATCH = [(1, 5), (7, 40), (1, 33), (20, 20), (1, 100), (3, 50), (1, 1)]
KERNEL_BATCH_LONG = KERNEL_BATCH + [(1, 1000), (64, 700), (1, 2049)]
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
ROOFLINE_TARGET = 0.25
GRAPH_SPEEDUP_TARGET = 3.0


@dataclass(frozen=True)
class Plan:
    dry_run: bool
    device: str
    max_model_len: int
    kv_cache_memory: str
    kernel_heads: tuple[tuple[int, int, int], ...]  # (heads, kv_heads, head_dim)
    kernel_batch: tuple[tuple[int, int], ...]
    parity_prompts: int
    parity_prompt_len: int
    parity_tokens: int
    batch: int
    prompt_len: int
    output_len: int
    batch1_prompt_len: int
    batch1_output_len: int
    pd_prompt_len: int
    pd_tokens: int
    copy_bytes: int

    @classmethod
    def gpu(cls) -> Plan:
        return cls(False, "cuda", 1024, "6GiB", ((9, 3, 64), (8, 1, 128), (4, 4, 64)), tuple(KERNEL_BATCH_LONG),
                   8, 32, 24, 256, 128, 128, 128, 128, 100, 16, 1 << 30)

    @classmethod
    def dry(cls) -> Plan:
        return cls(True, "cpu", 128, "64MiB", ((4, 2, 32),), tuple(KERNEL_BATCH), 2, 8, 4, 4, 8, 4, 8, 4, 12, 3,
                   1 << 22)
