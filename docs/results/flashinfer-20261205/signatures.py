"""Bind every call the FlashInfer backend (`kernels/flashinfer_attention.py`) makes against the installed
flashinfer's own signatures (a plan that takes **kwargs: against the keyword-only `_plan_impl` it forwards
them to), while the tests' stand-in computes (no CUDA here). The package outside the project's venv:

    pip download flashinfer-python --no-deps -d /tmp/fi_wheel
    pip install --no-deps --target /tmp/fi_target /tmp/fi_wheel/*.whl nvidia-ml-py apache-tvm-ffi einops tabulate
    PYTHONPATH=/tmp/fi_target:.:tests TRITON_INTERPRET=1 .venv/bin/python docs/results/flashinfer-20261205/signatures.py
"""
import inspect
import sys

import torch
import flashinfer as real
from flashinfer_stand_in import stand_in

from kernels.attention import AttentionSpec, CommonAttentionMetadata
from kernels.flashinfer_attention import FlashInferPagedAttention

fi = stand_in()
bound = []
for name in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"):
    fake, actual = getattr(fi, name), getattr(real, name)

    def wrap(method, fake_method, actual_method, cls_name=name, actual_cls=actual):
        sig = inspect.signature(actual_method)

        def checked(self, *args, **kwargs):
            b = sig.bind(self, *args, **kwargs)  # TypeError if the real one does not take them
            names = sorted(k for k in b.arguments if k != "self")
            if "kwargs" in b.arguments and hasattr(actual_cls, "_plan_impl"):
                inner = inspect.signature(actual_cls._plan_impl).bind(self, *args, **kwargs)
                names = sorted(k for k in inner.arguments if k != "self") + ["(via _plan_impl)"]
            bound.append((cls_name, method, names))
            return fake_method(self, *args, **kwargs)
        return checked

    for method in ("__init__", "plan", "run"):
        setattr(fake, method, wrap(method, getattr(fake, method), getattr(actual, method)))

backend = FlashInferPagedAttention("cpu", module=fi)
backend.check(AttentionSpec(16, torch.bfloat16, 9, 3, 64))
meta = backend.graph_metadata(torch.full((4,), -1), torch.zeros(4, 8, dtype=torch.long),
                              torch.ones(4, dtype=torch.long), torch.arange(5))
tables = torch.zeros(4, 8, dtype=torch.long)
tables[0, 0], tables[1, :2] = 1, torch.tensor([2, 3])
backend.prepare_graph_step(meta, torch.tensor([5, 17, 1, 1]), tables, 16)
kc = torch.randn(8, 16, 3, 64, dtype=torch.bfloat16)
backend.forward(torch.randn(4, 9, 64, dtype=torch.bfloat16), kc, kc.clone(), meta, 64 ** -0.5)
common = CommonAttentionMetadata(torch.tensor([1, 1]), torch.tensor([0, 1, 2]), torch.tensor([20, 3]),
                                 torch.tensor([[3, 5], [1, 0]]), torch.tensor([83, 18]), 16, 9, 3)
backend.forward(torch.randn(2, 9, 64, dtype=torch.bfloat16), kc, kc.clone(), backend.build_metadata(common), 64 ** -0.5)
print("flashinfer", real.__version__)
for b in dict.fromkeys((c, m, tuple(a)) for c, m, a in bound):
    print(*b)
