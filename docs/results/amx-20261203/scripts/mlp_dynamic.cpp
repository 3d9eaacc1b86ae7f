// The MLP (gate_up -> silu_and_mul -> down) over chunks of rows handed out from a shared counter, each chunk on
// one thread; built by mlp_dynamic.py with kernels/csrc_layer_ops.cpp
#include <torch/extension.h>
#include <omp.h>
#include <atomic>

torch::Tensor silu_and_mul(torch::Tensor gate_up);

static torch::Tensor linear_onednn(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(w);
  stack.emplace_back(bias.has_value() ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// The MLP over row chunks taken from a shared counter; each chunk on one thread (oneDNN runs serially inside
// the parallel region).
torch::Tensor mlp_dynamic_silu(torch::Tensor h, torch::Tensor gate_up, torch::Tensor down, int64_t chunk, int64_t out_features) {
  const int64_t rows = h.size(0);
  auto out = torch::empty({rows, out_features}, h.options());
  const int64_t n = (rows + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
#pragma omp parallel
  {
    at::NoGradGuard g;
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      const int64_t b = i * chunk, len = std::min(chunk, rows - b);
      auto y = linear_onednn(silu_and_mul(linear_onednn(h.narrow(0, b, len), gate_up, c10::nullopt)), down, c10::nullopt);
      out.narrow(0, b, len).copy_(y);
    }
  }
  return out;
}

int64_t in_par_threads() {
  int64_t r = 0;
#pragma omp parallel
  {
#pragma omp critical
    r += at::get_num_threads() * 100 + omp_in_parallel();
  }
  return r;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mlp_dynamic_silu", &mlp_dynamic_silu);
  m.def("in_par_threads", &in_par_threads);
}
