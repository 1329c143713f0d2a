// Random grads for the in-process rank tests: a random count of grads of random dtypes and sizes (the
// same on every rank, from a shared seed), registered in either layout, filled with each rank's
// reference inputs, and checked against the float64 reference of their reduction.
#pragma once

#include <cmath>
#include <random>
#include <vector>

#include "ddp.h"
#include "reference.hpp"

namespace ref {

struct RandomGrads {
  ddp_t d = nullptr;
  uint64_t seed = 0;
  bool arena = false;
  std::vector<ddp_dtype_t> types;
  std::vector<size_t> sizes;
  std::vector<std::vector<char>> bufs;  // the copy layout's storage
  std::vector<int> idx;

  // Registers 1..max_grads grads of up to 3000 elements with `d` (the layout of `cfg`).
  bool make(ddp_t ddp, uint64_t s, const ddp_config_t& cfg, std::mt19937_64& shared, int max_grads) {
    d = ddp, seed = s, arena = cfg.layout != 0;
    const size_t n = 1 + static_cast<size_t>(shared() % static_cast<uint64_t>(max_grads));
    types.resize(n), sizes.resize(n), bufs.resize(n), idx.resize(n);
    for (size_t k = 0; k < n; ++k) {
      types[k] = static_cast<ddp_dtype_t>(shared() % 4);
      sizes[k] = 1 + shared() % 3000;
      bufs[k].resize(sizes[k] * 8);
      if (ddp_register_grad(d, arena ? nullptr : bufs[k].data(), sizes[k], types[k], 0, &idx[k]) != DDP_SUCCESS)
        return false;
    }
    return true;
  }
  int count() const { return static_cast<int>(idx.size()); }
  void* at(int i) const {
    if (!arena) return const_cast<char*>(bufs[static_cast<size_t>(i)].data());
    void* p = nullptr;
    ddp_grad_ptr(d, idx[static_cast<size_t>(i)], &p);
    return p;
  }
  // This rank's inputs of iteration `it`.
  void fill(int rank, int it) const {
    for (int i = 0; i < count(); ++i)
      for (size_t e = 0; e < sizes[static_cast<size_t>(i)]; ++e)
        store(at(i), e, types[static_cast<size_t>(i)],
              quantize(raw_value(seed, rank, it, i, e), types[static_cast<size_t>(i)]));
  }
  // Whether grad i holds the reduction of iteration `it` over `world` ranks, scaled by `scale`.
  bool reduced(int i, int it, int world, double scale) const {
    const size_t k = static_cast<size_t>(i);
    for (size_t e = 0; e < sizes[k]; ++e) {
      double sum = 0, mag = 0;
      for (int r = 0; r < world; ++r) {
        const double v = quantize(raw_value(seed, r, it, i, e), types[k]);
        sum += v;
        mag += std::fabs(v);
      }
      if (!close(load(at(i), e, types[k]), sum * scale, mag * scale, types[k])) return false;
    }
    return true;
  }
};

}  // namespace ref
