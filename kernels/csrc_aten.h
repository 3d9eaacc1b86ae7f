// What the kernel sources use of ATen, for all but csrc_bindings.cpp. <torch/extension.h> (pybind11 and the
// whole C++ frontend) took ~24 s of every file's compile on a 2-core EPYC against ~2 s for ATen's tensor
// header; only the bindings need it, so a first build (a first `kvrelay serve`) no longer pays it seven times.
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

// torch::Tensor, torch::empty, torch::kInt, ... as <torch/types.h> names them: the same types and functions.
namespace torch {
using namespace at;  // NOLINT
constexpr auto kInt64 = at::kLong;
}
