"""The GEMV of one commit against the working tree's, in one process, alternated, on every linear layer of
SmolLM2-135M (30 layers, each its own weights, so they stream from memory) and the LM head, at 1-24 rows;
with a plain read of 256 MiB, one stream per thread and four side by side, for the host's bandwidth.

    python docs/results/gemv-streams-20261201/gemv_ab.py 7807850 [rounds]
"""
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load, load_inline

ROOT = Path(__file__).resolve().parents[3]
FLAGS = dict(extra_cflags=["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"],
             extra_ldflags=["-fopenmp"])
BIND = '\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("gemv", &gemv_bf16, py::call_guard<py::gil_scoped_release>()); }\n'
READ = r'''
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
int64_t read_streams(torch::Tensor t, int64_t S) {
  const int64_t n = t.numel() / 64;
  const auto* p = reinterpret_cast<const __m512i*>(t.data_ptr());
  std::vector<int64_t> sink(256);
  at::parallel_for(0, n, 1 << 12, [&](int64_t b, int64_t e) {
    const int64_t len = (e - b) / S / 2 * 2;
    __m512i acc[8];
    for (int s = 0; s < 8; ++s) acc[s] = _mm512_setzero_si512();
    for (int64_t i = 0; i < len; i += 2)
      for (int64_t s = 0; s < S; ++s) {
        acc[s] = _mm512_xor_si512(acc[s], _mm512_load_si512(p + b + s * len + i));
        acc[s] = _mm512_xor_si512(acc[s], _mm512_load_si512(p + b + s * len + i + 1));
      }
    __m512i a = acc[0];
    for (int s = 1; s < 8; ++s) a = _mm512_xor_si512(a, acc[s]);
    sink[at::get_thread_num()] = _mm512_reduce_add_epi64(a);
  });
  return sink[0];
}
'''


def build(name: str, source: str, folder: Path):
    (folder / name).mkdir(parents=True, exist_ok=True)
    path = folder / name / f"{name}.cpp"
    path.write_text(source.replace('#include "csrc_simd.h"', f'#include "{ROOT}/kernels/csrc_simd.h"') + BIND)
    return load(name=name, sources=[str(path)], build_directory=str(folder / name), **FLAGS)


def main() -> None:
    commit, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5
    torch.set_num_threads(2)
    folder = Path(tempfile.mkdtemp(prefix="gemv-ab-"))
    old_src = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:kernels/csrc_gemv_bf16.cpp"],
                             capture_output=True, text=True, check=True).stdout
    old = build("gemv_old", old_src, folder)
    new = build("gemv_new", (ROOT / "kernels/csrc_gemv_bf16.cpp").read_text(), folder)
    rd = load_inline("read_streams", READ, functions=["read_streams"], build_directory=str(folder), **FLAGS)
    g = torch.Generator().manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    layers = [[torch.randn(n, k, generator=g).to(torch.bfloat16) for n, k in shapes] for _ in range(30)]
    head = torch.randn(49152, 576, generator=g).to(torch.bfloat16)
    nbytes = sum(w.numel() * 2 for ws in layers for w in ws) + head.numel() * 2
    big = torch.ones(256 << 20, dtype=torch.uint8)
    rows = (1, 4, 8, 16, 24)
    xs = {m: (torch.randn(m, 576, generator=g).to(torch.bfloat16), torch.randn(m, 1536, generator=g).to(torch.bfloat16))
          for m in rows}
    for m, (a, b) in xs.items():  # the same bits
        for w in layers[0] + [head]:
            x = a if w.shape[1] == 576 else b
            assert torch.equal(old.gemv(x, w, None), new.gemv(x, w, None)), (m, tuple(w.shape))

    def token(f, m):
        a, b = xs[m]
        for ws in layers:
            for w in ws:
                f(a if w.shape[1] == 576 else b, w, None)
        f(a, head, None)

    def median(fn, reps=9):
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[reps // 2]

    print("GB/s of weights read (median of 9 tokens); the old kernel -> the new one")
    for _ in range(rounds):
        line = " | ".join(f"read {s} stream{'s' if s > 1 else ''}/thread {big.numel() / median(lambda s=s: rd.read_streams(big, s)) / 1e9:5.1f}"
                          for s in (1, 4))
        for m in rows:
            o, n = (nbytes / median(lambda f=f: token(f, m)) / 1e9 for f in (old.gemv, new.gemv))
            line += f" | {m} rows {o:4.1f} -> {n:4.1f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
