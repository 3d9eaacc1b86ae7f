"""The KV cache's huge pages: a mapping of its own, advised before anything touches it."""

from pathlib import Path

import pytest
import torch

from workers.huge_pages import HUGE_PAGE, zeros_on_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The bracketed choice of Linux's transparent huge pages, or None where there are none."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


def huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings that hold the tensor's memory (/proc/self/smaps)."""
    start, end = t.data_ptr(), t.data_ptr() + t.nbytes
    inside, total = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and all(c in "0123456789abcdef-" for c in fields[0]):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            inside = lo < end and hi > start
        elif inside and fields and fields[0] == "AnonHugePages:":
            total += int(fields[1])
    return total


def test_small_or_non_cpu_tensors_are_plain_zeros() -> None:
    t = zeros_on_huge_pages(3, 5, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and not t.any()
    m = zeros_on_huge_pages(4, HUGE_PAGE, dtype=torch.uint8, device=torch.device("meta"))
    assert m.device.type == "meta" and m.shape == (4, HUGE_PAGE)
    big = zeros_on_huge_pages(3, HUGE_PAGE // 4 + 1, dtype=torch.float32, device=torch.device("cpu"))
    assert big.shape == (3, HUGE_PAGE // 4 + 1) and big.is_contiguous() and not big.any()
    big += 1  # writable
    assert big.sum().item() == big.numel()


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"), reason="this kernel gives no transparent huge pages")
def test_zeros_land_on_huge_pages() -> None:
    for _ in range(3):  # memory malloc has touched and freed, which a plain allocation would reuse
        torch.ones(32 * 2**20, dtype=torch.uint8)
    small = torch.zeros(32 * 2**20, dtype=torch.uint8)
    t = zeros_on_huge_pages(32, 2**20, dtype=torch.uint8, device=torch.device("cpu"))
    assert not t.any()
    # most of it (the kernel falls back to small pages where it finds no free 2 MiB)
    assert huge_kib(t) * 1024 >= t.nbytes // 2, f"{huge_kib(t)} KiB on huge pages"
    if thp_mode() == "madvise":
        assert huge_kib(small) == 0  # torch's own allocation is not advised: the comparison means something


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"), reason="this kernel gives no transparent huge pages")
def test_the_engines_kv_cache_is_on_huge_pages(tiny_model_dir) -> None:
    from workers.config import EngineConfig
    from workers.engine import Engine

    engine = Engine(EngineConfig(model=tiny_model_dir, dtype="float32", max_model_len=256, kv_cache_memory="16MiB"))
    cache = engine.runner.kv_cache
    assert cache.nbytes >= 8 * HUGE_PAGE and not cache.any()
    assert huge_kib(cache) * 1024 >= cache.nbytes // 2
