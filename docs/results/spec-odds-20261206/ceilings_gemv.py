# The ceilings' one-row GEMV at the default model's shapes, float32, 2 threads: per matmul the faster of F.linear
# and the compiled gemv_f32 (`gemv_kernels`), F.linear's own GB/s beside it, and the forward's matmuls as tok/s.
# PYTHONPATH=. .venv/bin/python docs/results/spec-odds-20261206/ceilings_gemv.py
import json
from loadtest.ceilings import measure_ceilings
from loadtest.model_shape import ModelShape
from workers.model_loader import resolve_model_path
shape = ModelShape.from_folder(resolve_model_path(None))
c = measure_ceilings(shape, threads=2, dtype="float32", rows=64)
print(json.dumps({"cpu": c.cpu.model_name, "gemv_kernels": c.gemv_kernels,
                  "gemv_gbs": {k: round(v, 1) for k, v in c.gemv_gbs.items()},
                  "gemv_gbs_torch": {k: round(v, 1) for k, v in c.gemv_gbs_torch.items()},
                  "gemv_tok_s": round(c.gemv_tok_s, 1), "read_gbs": round(c.read_gbs, 1)}, indent=1))
