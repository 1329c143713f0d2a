// The gradient sizes the benchmarks share (and bench/torch_ddp.py reads from `ddp_bench sizes`):
// a GPT-like transformer of 24 blocks, width 576, vocabulary 8192: per block the attention's fused
// qkv weight and bias, its output projection and bias, two layer norms (weight, bias), the MLP's two
// weights and biases (12 grads); then the embeddings and the final norm. 24 * 12 + 4 = 292 grads,
// 101.6M f32 elements (406 MB), in registration (forward) order.
#pragma once

#include <cstddef>
#include <vector>

inline std::vector<size_t> transformer_grad_sizes() {
  const size_t d = 576, vocab = 8192, ctx = 2048, blocks = 24;
  std::vector<size_t> s;
  s.push_back(vocab * d);  // token embedding
  s.push_back(ctx * d);    // position embedding
  for (size_t b = 0; b < blocks; ++b) {
    s.push_back(d);          // ln1 weight
    s.push_back(d);          // ln1 bias
    s.push_back(3 * d * d);  // qkv weight
    s.push_back(3 * d);      // qkv bias
    s.push_back(d * d);      // attention output weight
    s.push_back(d);          // attention output bias
    s.push_back(d);          // ln2 weight
    s.push_back(d);          // ln2 bias
    s.push_back(4 * d * d);  // mlp up weight
    s.push_back(4 * d);      // mlp up bias
    s.push_back(4 * d * d);  // mlp down weight
    s.push_back(d);          // mlp down bias
  }
  s.push_back(d);  // final norm weight
  s.push_back(d);  // final norm bias
  return s;
}
