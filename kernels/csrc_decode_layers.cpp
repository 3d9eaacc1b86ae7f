// Every decoder layer of a decode-only step of bfloat16 rows in one call: the same kernels, in the same order
// and with the same roundings, as the Python layer loop of `workers/models/llama.py` with the compiled ops
// (GEMV or oneDNN's prepacked linear, RoPE, KV write, paged decode attention, add+RMSNorm, SiLU-and-mul). At
// one to a few rows a layer's ten ops each take tens of microseconds of memory time, and the Python between
// them (module calls, views, attribute reads) cost as much again; here that Python runs once per step, and
// the GIL is released for the whole stack instead of being taken back after each op, so a replica's event
// loop does not hold the engine thread up between ops (burst through the server +7% on a 2-core Xeon with
// AMX, whose decode steps past 8 rows take oneDNN; docs/benchmarks.md). `mixed_layers_bf16` does the same
// for a step with prefill chunks, up to the last layer's attention (offline bursts +2-7%, poisson QPS 4 TTFT
// p50 86-88 -> 76-77 ms through the server on the same host).
#include "csrc_aten.h"

#include <vector>

torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor amx_linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
int64_t gemv_out_features(const torch::Tensor& w);
void rope_(torch::Tensor x, torch::Tensor cos_table, torch::Tensor sin_table, torch::Tensor positions);
void write_kv_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor key, torch::Tensor value, torch::Tensor slots);
torch::Tensor paged_decode_attention_bf16(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                          torch::Tensor block_tables, torch::Tensor context_lens, double scale);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
void paged_prefill_attention_bf16_(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor block_tables, torch::Tensor starts, torch::Tensor query_lens,
                                   torch::Tensor context_lens, double scale);

constexpr int64_t kWeightsPerLayer = 7;  // qkv, qkv bias (empty: none), o_proj, post norm, gate_up, down, next norm

// oneDNN's linear over a weight in its blocked layout (`mkldnn::_linear_pointwise`): the op that
// `kernels.layer_ops.linear_packed` calls from Python, with the same arguments, so the same bits. oneDNN
// compiles a primitive for every row count it meets (1-2 ms each for SmolLM2-135M's shapes), and a decode
// step's row count is seldom the last one's: `row_bucket` > 1 pads the rows with zeros up to a multiple of
// it, so steps share primitives, and returns the real rows (a view).
torch::Tensor linear_onednn(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                            int64_t row_bucket) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  TORCH_CHECK(row_bucket >= 1, "row_bucket must be at least 1");
  const int64_t rows = x.size(0), padded = (rows + row_bucket - 1) / row_bucket * row_bucket;
  torch::Tensor in = x;
  if (padded != rows) {
    in = torch::zeros({padded, x.size(1)}, x.options());
    in.narrow(0, 0, rows).copy_(x);
  }
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(in);
  stack.emplace_back(w);
  stack.emplace_back(bias.has_value() ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  torch::Tensor out = stack[0].toTensor();
  return padded != rows ? out.narrow(0, 0, rows) : out;
}

// A stack's linear: oneDNN's copies (`onednn`), the AMX kernel over the VNNI copies (`amx`), else the GEMV.
static torch::Tensor stack_linear(const torch::Tensor& in, const torch::Tensor& weight, const c10::optional<torch::Tensor>& b,
                                  bool onednn, bool amx, int64_t row_bucket) {
  if (onednn) return linear_onednn(in, weight, b, row_bucket);
  return amx && weight.dim() == 4 ? amx_linear_bf16(in, weight, b) : gemv_bf16(in, weight, b);
}

// A layer's qkv from its input norm `h` (w: the layer's kWeightsPerLayer weights), RoPE on q and k, k and v
// written to the caches: returns q, [rows, heads, head_dim] (a strided view of qkv).
static torch::Tensor layer_query(const torch::Tensor& h, const torch::Tensor* w, const torch::Tensor& k_cache,
                                 const torch::Tensor& v_cache, const torch::Tensor& cos_table, const torch::Tensor& sin_table,
                                 const torch::Tensor& positions, const torch::Tensor& slots, int64_t nh, int64_t kvh,
                                 bool onednn, bool amx, int64_t row_bucket) {
  const int64_t t = h.size(0), d = k_cache.size(3);
  const int64_t qkv_rows = onednn ? w[0].size(0) : gemv_out_features(w[0]);
  TORCH_CHECK(qkv_rows == (nh + 2 * kvh) * d, "qkv has ", qkv_rows, " rows, not ", (nh + 2 * kvh) * d);
  const c10::optional<torch::Tensor> bias = w[1].numel() > 0 ? c10::optional<torch::Tensor>(w[1]) : c10::nullopt;
  const torch::Tensor qkv = stack_linear(h, w[0], bias, onednn, amx, row_bucket);
  const torch::Tensor qk = qkv.narrow(1, 0, (nh + kvh) * d).view({t, nh + kvh, d});
  rope_(qk, cos_table, sin_table, positions);
  const torch::Tensor v = qkv.narrow(1, (nh + kvh) * d, kvh * d).view({t, kvh, d});
  write_kv_(k_cache, v_cache, qk.narrow(1, nh, kvh), v, slots);
  return qk.narrow(1, 0, nh);
}

// x: [rows, hidden], the residual stream (updated in place); h: its input norm for the first layer. `weights`
// holds kWeightsPerLayer tensors per layer ("next norm": the next layer's input norm, the final norm for the
// last layer), the matrices plain or VNNI-packed, as `gemv_bf16` takes them, or (`onednn`) all in oneDNN's
// blocked layout, for steps of more rows than the GEMV is the faster for; `amx`: the VNNI-packed matrices on
// AMX tiles (`amx_linear_bf16`) instead of the GEMV, for steps between the two; `caches` the K and V cache of
// each layer; `row_bucket`: see `linear_onednn`. Returns the last layer's output norm.
torch::Tensor decode_layers_bf16(torch::Tensor x, torch::Tensor h, std::vector<torch::Tensor> weights,
                                 std::vector<torch::Tensor> caches, torch::Tensor cos_table, torch::Tensor sin_table,
                                 torch::Tensor positions, torch::Tensor slots, torch::Tensor block_tables,
                                 torch::Tensor context_lens, int64_t num_heads, int64_t num_kv_heads, double eps,
                                 double scale, bool onednn, bool amx, int64_t row_bucket) {
  const int64_t layers = static_cast<int64_t>(caches.size()) / 2;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer && caches.size() % 2 == 0,
              "decode_layers_bf16 takes ", kWeightsPerLayer, " weights and 2 caches per layer");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && h.sizes() == x.sizes(), "x and h must be contiguous [rows, hidden]");
  const int64_t t = x.size(0), nh = num_heads, kvh = num_kv_heads;
  TORCH_CHECK(nh > 0 && kvh > 0 && nh % kvh == 0, "query heads must be a positive multiple of KV heads");
  positions = positions.to(torch::kInt64).contiguous();
  slots = slots.to(torch::kInt64).contiguous();
  block_tables = block_tables.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
  const auto linear = [onednn, amx, row_bucket](const torch::Tensor& in, const torch::Tensor& weight,
                                                const c10::optional<torch::Tensor>& b) {
    return stack_linear(in, weight, b, onednn, amx, row_bucket);
  };
  for (int64_t i = 0; i < layers; ++i) {
    const torch::Tensor* w = weights.data() + i * kWeightsPerLayer;
    const torch::Tensor& k_cache = caches[2 * i];
    const torch::Tensor& v_cache = caches[2 * i + 1];
    const int64_t d = k_cache.size(3);
    const torch::Tensor q = layer_query(h, w, k_cache, v_cache, cos_table, sin_table, positions, slots, nh, kvh,
                                        onednn, amx, row_bucket);
    const torch::Tensor o = paged_decode_attention_bf16(q, k_cache, v_cache, block_tables, context_lens, scale)
                                .view({t, nh * d});
    h = add_rms_norm(x, linear(o, w[2], c10::nullopt), w[3], eps);
    h = add_rms_norm(x, linear(silu_and_mul(linear(h, w[4], c10::nullopt)), w[5], c10::nullopt), w[6], eps);
  }
  return h;
}

// [blocks, block_size, kv heads, d] gathered by a [b, nb] block table -> [b, kv heads, nb * block_size, d], as
// `kernels.cpu_attention.gather_kv`.
static torch::Tensor gather_kv(const torch::Tensor& cache, const torch::Tensor& block_tables) {
  const int64_t b = block_tables.size(0), nb = block_tables.size(1);
  return cache.index_select(0, block_tables.flatten())
      .view({b, nb * cache.size(1), cache.size(2), cache.size(3)})
      .transpose(1, 2);
}

// The attention of a step with prefill chunks, as `CppPagedAttention.forward` runs it in bfloat16 on its
// "kernel", "flash" and "split" paths, with the same ops in the same order (so the same bits). `a` (an empty
// tensor where a group is absent): the decodes' rows, block tables and contexts; the chunks that go to the
// kernel (block tables, first rows, query lengths, contexts); the whole prompts of `flash_len` tokens that
// go to torch's flash attention (block tables, and their rows as an index, or empty when they are the
// `flash_start`.. rows, one run).
static torch::Tensor mixed_attention(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                     const std::vector<torch::Tensor>& a, int64_t flash_len, int64_t flash_start,
                                     double scale) {
  torch::Tensor out = torch::empty_like(query);
  if (a[0].numel() > 0) {
    out.index_put_({a[0]}, paged_decode_attention_bf16(query.index({a[0]}), k_cache, v_cache, a[1], a[2], scale));
  }
  if (flash_len > 0) {
    const int64_t r = a[7].size(0), n = flash_len, heads = query.size(1), d = query.size(2);
    const torch::Tensor rows = flash_start >= 0 ? query.narrow(0, flash_start, r * n) : query.index({a[8]});
    const torch::Tensor q = rows.view({r, n, heads, d}).transpose(1, 2);
    const torch::Tensor k = gather_kv(k_cache, a[7]).narrow(2, 0, n);
    const torch::Tensor v = gather_kv(v_cache, a[7]).narrow(2, 0, n);
    const torch::Tensor o = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, scale, /*enable_gqa=*/true)
                                .transpose(1, 2)
                                .reshape({r * n, heads, d});
    if (flash_start >= 0) {
      out.narrow(0, flash_start, r * n).copy_(o);
    } else {
      out.index_put_({a[8]}, o);
    }
  }
  if (a[4].numel() > 0) paged_prefill_attention_bf16_(out, query, k_cache, v_cache, a[3], a[4], a[5], a[6], scale);
  return out;
}

// A step with prefill chunks (and any decodes beside them) through every decoder layer in one call without the
// GIL, as `decode_layers_bf16` runs a decode-only step: the layer loop's kernels in its order, the attention
// as `mixed_attention` says. It stops after the last layer's attention, because only the rows that sample go
// on from there (the caller finishes that layer): returns {x, o}, the residual stream and the last layer's
// attention output [rows, heads * head_dim]. Arguments as `decode_layers_bf16`'s, with `attn`, `flash_len`
// and `flash_start` as `mixed_attention` takes them.
std::vector<torch::Tensor> mixed_layers_bf16(torch::Tensor x, torch::Tensor h, std::vector<torch::Tensor> weights,
                                             std::vector<torch::Tensor> caches, torch::Tensor cos_table,
                                             torch::Tensor sin_table, torch::Tensor positions, torch::Tensor slots,
                                             std::vector<torch::Tensor> attn, int64_t flash_len, int64_t flash_start,
                                             int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
                                             bool onednn, bool amx, int64_t row_bucket) {
  const int64_t layers = static_cast<int64_t>(caches.size()) / 2;
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer && caches.size() % 2 == 0,
              "mixed_layers_bf16 takes ", kWeightsPerLayer, " weights and 2 caches per layer, at least one layer");
  TORCH_CHECK(attn.size() == 9, "mixed_layers_bf16 takes 9 attention tensors");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && h.sizes() == x.sizes(), "x and h must be contiguous [rows, hidden]");
  const int64_t t = x.size(0), nh = num_heads, kvh = num_kv_heads;
  TORCH_CHECK(nh > 0 && kvh > 0 && nh % kvh == 0, "query heads must be a positive multiple of KV heads");
  for (int64_t i = 0; i < layers; ++i) {
    const torch::Tensor* w = weights.data() + i * kWeightsPerLayer;
    const torch::Tensor& k_cache = caches[2 * i];
    const torch::Tensor& v_cache = caches[2 * i + 1];
    const int64_t d = k_cache.size(3);
    const torch::Tensor q = layer_query(h, w, k_cache, v_cache, cos_table, sin_table, positions, slots, nh, kvh,
                                        onednn, amx, row_bucket);
    const torch::Tensor o = mixed_attention(q, k_cache, v_cache, attn, flash_len, flash_start, scale).view({t, nh * d});
    if (i == layers - 1) return {x, o};
    h = add_rms_norm(x, stack_linear(o, w[2], c10::nullopt, onednn, amx, row_bucket), w[3], eps);
    h = add_rms_norm(x, stack_linear(silu_and_mul(stack_linear(h, w[4], c10::nullopt, onednn, amx, row_bucket)), w[5],
                                     c10::nullopt, onednn, amx, row_bucket),
                     w[6], eps);
  }
  return {x, h};  // not reached
}
