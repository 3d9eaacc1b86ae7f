# A probe, not the engine's code: an fp32 GEMV for 1-8 rows (plain C++, one pass over W per call, the rows' sums
# together, -O3 -march=native, OpenMP over output features) against F.linear, 30 layers of SmolLM2-135M-like shapes, each its own weights.
import time, sys
import torch, torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

src = r'''
#include <torch/extension.h>
template <int M>
static void rows_kernel(const float* X, const float* W, float* Y, int64_t K, int64_t N) {
  #pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* wr = W + n * K;
    float s[M];
    for (int m = 0; m < M; ++m) s[m] = 0.f;
    #pragma omp simd reduction(+:s[:M])
    for (int64_t k = 0; k < K; ++k) {
      const float wk = wr[k];
      for (int m = 0; m < M; ++m) s[m] += X[m * K + k] * wk;
    }
    for (int m = 0; m < M; ++m) Y[m * N + n] = s[m];
  }
}
torch::Tensor gemv_f32(torch::Tensor x, torch::Tensor w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>(); const float* W = w.data_ptr<float>(); float* Y = y.data_ptr<float>();
  switch (M) {
    case 1: rows_kernel<1>(X, W, Y, K, N); break;
    case 2: rows_kernel<2>(X, W, Y, K, N); break;
    case 3: rows_kernel<3>(X, W, Y, K, N); break;
    case 4: rows_kernel<4>(X, W, Y, K, N); break;
    case 5: rows_kernel<5>(X, W, Y, K, N); break;
    case 6: rows_kernel<6>(X, W, Y, K, N); break;
    case 7: rows_kernel<7>(X, W, Y, K, N); break;
    case 8: rows_kernel<8>(X, W, Y, K, N); break;
    default: TORCH_CHECK(false, "rows");
  }
  return y;
}
'''
ext = load_inline("gemv32_probe2", cpp_sources=src, functions=["gemv_f32"], extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                  extra_ldflags=["-fopenmp"], verbose=False)
torch.set_num_threads(2)
shapes = [(192 + 2 * 64, 576), (576, 576), (3072, 576), (576, 1536)]  # o, gate_up, down as the model's; the first narrower than its qkv (960)
layers = [[torch.randn(n, k) * 0.02 for n, k in shapes] for _ in range(30)]
nbytes = sum(w.nbytes for l in layers for w in l)
for rows in (1, 2, 5, 8):
    xs = {k: torch.randn(rows, k) for _, k in shapes}
    for name, fn in (("F.linear", lambda x, w: F.linear(x, w)), ("gemv_f32", ext.gemv_f32)):
        best = 1e9
        for _ in range(7):
            t = time.perf_counter()
            for l in layers:
                for w in l:
                    fn(xs[w.shape[1]], w)
            best = min(best, time.perf_counter() - t)
        print(f"rows {rows} {name}: {best*1e3:.2f} ms for {nbytes/2**20:.0f} MiB = {nbytes/best/1e9:.1f} GB/s")
    for w in layers[0]:
        x = xs[w.shape[1]]
        print("  max abs diff", (ext.gemv_f32(x, w) - F.linear(x, w)).abs().max().item(), end="")
    print()
