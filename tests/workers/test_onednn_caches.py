"""An engine process's memory must not grow with every new step size: with the caches bounded, bf16
linears over hundreds of distinct row counts stop adding memory once the caches are full."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kernels.cpu_extension import onednn_bf16

_PROBE = """
import ctypes, json, sys
import torch
if sys.argv[1] == "bounded":
    from workers.onednn_caches import bound_onednn_caches
    bound_onednn_caches()
torch.set_num_threads(1)

def rss():
    # freed buffers that malloc keeps in its heap are not what the caches hold: hand them back first, so
    # the reading is the live memory (without this, readings swung by +-100 MiB from run to run)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

w = torch.randn(3072, 576, dtype=torch.bfloat16)
linear = torch.nn.functional.linear
if sys.argv[2] == "packed":  # the copy that `prepack_weights` reads
    from kernels.layer_ops import linear_packed
    w, linear = torch.ops.mkldnn._reorder_linear_weight(w, None), lambda x, p: linear_packed(x, p, None)
first, last = int(sys.argv[3]), int(sys.argv[4])
marks = {}
for m in range(1, last + 1):
    linear(torch.randn(m, 576, dtype=torch.bfloat16), w)
    if m in (first, last):
        marks[m] = rss()
print(json.dumps(marks[last] - marks[first]))
"""


def _growth_mib(mode: str, weights: str = "plain", first: int = 100, last: int = 400) -> float:
    """RSS growth in MiB from the `first` to the `last` of the row counts 1, 2, ... run in turn."""
    env = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", _PROBE, mode, weights, str(first), str(last)], capture_output=True, text=True, timeout=300, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmRSS from /proc")
@pytest.mark.skipif(not onednn_bf16(), reason="oneDNN has no bfloat16 path on this CPU: no primitives to cache")
def test_bounded_caches_stop_growing_with_new_shapes() -> None:
    default = _growth_mib("default")
    if default < 100:
        pytest.skip(f"this torch build does not cache a primitive per bf16 shape (+{default:.0f} MiB)")
    bounded = _growth_mib("bounded")
    assert bounded < 50, f"300 new shapes grew RSS by {bounded:.0f} MiB with bounded caches ({default:.0f} unbounded)"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmRSS from /proc")
@pytest.mark.skipif(not onednn_bf16(), reason="oneDNN has no bfloat16 path on this CPU: nothing is packed")
def test_bounded_caches_bound_the_packed_weights_path_too() -> None:
    """`prepack_weights`' linears go through both of oneDNN's caches as well (unbounded, this probe grew
    +240 MiB from 500 to 900 rows). Their primitives hold buffers that grow with the row count, so the
    bounded caches fill later (~+175 MiB by 400 rows), and then stop growing."""
    bounded = _growth_mib("bounded", "packed", 500, 900)
    assert bounded < 50, f"400 new shapes grew RSS by {bounded:.0f} MiB over packed weights with full bounded caches"
