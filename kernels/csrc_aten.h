// What the kernel sources use of ATen, instead of <torch/extension.h> (pybind11 and the whole C++ frontend),
// which took ~24 s of each file's compile on a 2-core EPYC against ~2 s for ATen's tensor header: seven times
// in a first build, that is, in a first `kvrelay serve`. The bindings add torch's pybind11 header to this.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/zeros.h>

// torch::Tensor, torch::empty, torch::kInt64, ... as <torch/types.h> names them: the same types and functions.
namespace torch {
using namespace at;  // NOLINT
constexpr auto kInt64 = at::kLong;
}
