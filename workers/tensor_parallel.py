"""Tensor parallelism inside one model: which slice of each weight a rank holds, and the collectives that
join the slices (Megatron's layout, as vLLM uses it).

Query heads, the MLP's intermediate features and the vocabulary are split evenly across ranks. KV heads
are split too when there are at least as many as ranks; with fewer, each KV head is replicated on
`size // num_kv_heads` ranks, beside the query heads that read it. A `TPShard` of size 1 is the whole
model and every collective is a no-op."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TPShard:
    rank: int = 0
    size: int = 1
    group: object | None = None  # the torch.distributed process group; None when size is 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of the row-parallel partial results `x`, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor, full: int) -> torch.Tensor:
        """Every rank's `x` side by side along the last dimension, cut to `full` columns."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., :full]


@dataclass(frozen=True, slots=True)
class Partition:
    """One rank's ranges: query heads, KV heads, intermediate features and vocabulary rows
    (`vocab_rows` per rank, the last rank's range padded past the vocabulary)."""

    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_rows: int

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]


def check_tp_size(size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """Raise ValueError unless a model of this shape splits over `size` ranks."""
    problems = []
    if num_heads % size:
        problems.append(f"its {num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        problems.append(f"its {num_kv_heads} KV heads (nor does {size} divide by them)")
    if intermediate_size % size:
        problems.append(f"its intermediate size {intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size {size} does not divide {' and '.join(problems)}; choose a size "
                         "that does")


def partition(rank: int, size: int, num_heads: int, num_kv_heads: int, intermediate_size: int,
              vocab_size: int) -> Partition:
    check_tp_size(size, num_heads, num_kv_heads, intermediate_size)
    h = num_heads // size
    if num_kv_heads >= size:
        kv = num_kv_heads // size
        kv_range = (rank * kv, (rank + 1) * kv)
    else:
        first = rank // (size // num_kv_heads)
        kv_range = (first, first + 1)
    i = intermediate_size // size
    rows = -(-vocab_size // size)
    return Partition((rank * h, (rank + 1) * h), kv_range, (rank * i, (rank + 1) * i),
                     (min(rank * rows, vocab_size), min((rank + 1) * rows, vocab_size)), rows)
