"""What one run measures and at what size: the full check on a GPU, or a tiny dry run on the CPU that
exercises every path (Triton in its interpreter, graphs replayed eagerly)."""

from __future__ import annotations

from dataclasses import dataclass

# (new tokens this step, context length including them): decodes and chunks mixed, off block boundaries
KERNEL_BATCH = [(1, 5), (7, 40), (1, 33), (20, 20), (1, 100), (3, 50), (1, 1)]
KERNEL_BATCH_LONG = KERNEL_BATCH + [(1, 1000), (64, 700), (1, 2049)]
KERNEL_BATCH_DRY = [(1, 5), (7, 40), (1, 33), (3, 3)]
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
    warmup_tokens: int
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
    # the sweeps' graphs: a step's worth of launches, one per layer, each over its own weights or KV
    sweep_layers: int
    # the decode profile: steps under torch's profiler, then under Python's (the host's share)
    profiled_steps: int
    host_steps: int

    @classmethod
    def gpu(cls) -> Plan:
        return cls(dry_run=False, device="cuda", max_model_len=1024, kv_cache_memory="6GiB",
                   kernel_heads=((9, 3, 64), (8, 1, 128), (4, 4, 64)), kernel_batch=tuple(KERNEL_BATCH_LONG),
                   warmup_tokens=4, parity_prompts=8, parity_prompt_len=32, parity_tokens=24, batch=256,
                   prompt_len=128, output_len=128, batch1_prompt_len=128, batch1_output_len=128, pd_prompt_len=100,
                   pd_tokens=16, copy_bytes=1 << 30, sweep_layers=30, profiled_steps=3, host_steps=10)

    @classmethod
    def dry(cls) -> Plan:
        return cls(dry_run=True, device="cpu", max_model_len=64, kv_cache_memory="16MiB",
                   kernel_heads=((4, 2, 32),), kernel_batch=tuple(KERNEL_BATCH_DRY), warmup_tokens=1,
                   parity_prompts=2, parity_prompt_len=8, parity_tokens=3, batch=2, prompt_len=8, output_len=3,
                   batch1_prompt_len=8, batch1_output_len=3, pd_prompt_len=10, pd_tokens=2, copy_bytes=1 << 22,
                   sweep_layers=2, profiled_steps=1, host_steps=2)
