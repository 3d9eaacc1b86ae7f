// The Python module of kvrelay's compiled CPU kernels (sources: csrc_paged_decode.cpp, csrc_attention_bf16.cpp,
// csrc_layer_ops.cpp, csrc_gemv_bf16.cpp, csrc_gemv_f32.cpp, csrc_amx_linear.cpp, csrc_decode_layers.cpp).
// torch's pybind11 and its casters for tensors, without the rest of <torch/extension.h> (the whole C++ frontend:
// the header alone took 24 against 7 s of a file's compile on a 2-core EPYC)
#include <torch/csrc/utils/pybind.h>

#include "csrc_aten.h"

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale);
bool has_avx512_bf16();
void paged_prefill_attention_bf16_(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor block_tables, torch::Tensor q_starts, torch::Tensor q_lens,
                                   torch::Tensor context_lens, double scale);
torch::Tensor paged_decode_attention_bf16(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                          torch::Tensor block_tables, torch::Tensor context_lens, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rope_(torch::Tensor x, torch::Tensor cos_table, torch::Tensor sin_table, torch::Tensor positions);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor argmax_bf16(torch::Tensor logits);
void write_kv_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor key, torch::Tensor value, torch::Tensor slots);
torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor pack_vnni_bf16(torch::Tensor w);
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t max_rows,
                          int64_t f32_max_rows);
torch::Tensor gemv_f32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
bool has_amx_linear();
torch::Tensor amx_linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor decode_layers_bf16(torch::Tensor x, torch::Tensor h, std::vector<torch::Tensor> weights,
                                 std::vector<torch::Tensor> caches, torch::Tensor cos_table, torch::Tensor sin_table,
                                 torch::Tensor positions, torch::Tensor slots, torch::Tensor block_tables,
                                 torch::Tensor context_lens, int64_t num_heads, int64_t num_kv_heads, double eps,
                                 double scale, bool onednn, bool amx, int64_t row_bucket);
torch::Tensor linear_onednn(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                            int64_t row_bucket);
std::vector<torch::Tensor> mixed_layers_bf16(torch::Tensor x, torch::Tensor h, std::vector<torch::Tensor> weights,
                                             std::vector<torch::Tensor> caches, torch::Tensor cos_table,
                                             torch::Tensor sin_table, torch::Tensor positions, torch::Tensor slots,
                                             std::vector<torch::Tensor> attn, int64_t flash_len, int64_t flash_start,
                                             int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
                                             bool onednn, bool amx, int64_t row_bucket);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged attention for single-token queries");
  m.def("has_avx512_bf16", &has_avx512_bf16, "whether the bfloat16 attention and GEMV kernels were compiled");
  m.def("paged_prefill_attention_bf16_", &paged_prefill_attention_bf16_, "causal chunk attention over the paged cache, bfloat16");
  m.def("paged_decode_attention_bf16", &paged_decode_attention_bf16, "paged attention for single-token queries, bfloat16");
  m.def("rms_norm", &rms_norm, "RMSNorm rounded as Hugging Face's torch code rounds");
  m.def("add_rms_norm", &add_rms_norm, "x += residual in place, then RMSNorm of x");
  m.def("rope_", &rope_, "rotary embedding in place, from cos/sin tables and positions");
  m.def("write_kv_", &write_kv_, "copy each token's K/V rows into its cache slot");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up over [rows, 2n] -> [rows, n]");
  m.def("argmax_bf16", &argmax_bf16, "each row's first maximum (NaN above all), as torch.max(dim=-1).indices",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemv_bf16", &gemv_bf16, "x [M, K] @ W[N, K]^T (+ bias) for a few rows, bfloat16",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("pack_vnni_bf16", &pack_vnni_bf16, "W [N, K] -> [N/16, K/2, 16, 2], the layout gemv_bf16 reads fastest",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemv_f32", &gemv_f32, "x [M, K] @ W[N, K]^T (+ bias) for 1 to 64 rows, float32, W read once",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("linear_bf16", &linear_bf16,
        "gemv_bf16 for at most max_rows bfloat16 rows, gemv_f32 for at most f32_max_rows float32 rows, else at::linear",
        py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("max_rows"), py::arg("f32_max_rows") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("has_amx_linear", &has_amx_linear, "whether this CPU and OS run amx_linear_bf16 (AMX tiles, bfloat16)");
  m.def("amx_linear_bf16", &amx_linear_bf16, "x [M, K] @ W^T (+ bias) on AMX tiles, W packed by pack_vnni_bf16, bfloat16",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("linear_onednn", &linear_onednn,
        "oneDNN's linear over a prepacked weight, the rows padded with zeros to a multiple of row_bucket",
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_layers_bf16", &decode_layers_bf16, "every decoder layer of a decode-only step of bfloat16 rows",
        py::call_guard<py::gil_scoped_release>());
  m.def("mixed_layers_bf16", &mixed_layers_bf16,
        "every decoder layer of a step with prefill chunks, bfloat16, up to the last layer's attention",
        py::call_guard<py::gil_scoped_release>());
}
