#include "core/host_reduce.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/elementwise.h"

namespace ddp {

bool host_dtype_valid(int dtype) { return dtype_valid(dtype) || dtype == DDP_I32 || dtype == DDP_I64; }

size_t host_dtype_size(int dtype) {
  if (dtype == DDP_I32) return 4;
  if (dtype == DDP_I64) return 8;
  return dtype_size(static_cast<Dtype>(dtype));
}

const char* host_dtype_name(int dtype) {
  if (dtype == DDP_I32) return "i32";
  if (dtype == DDP_I64) return "i64";
  return dtype_name(static_cast<Dtype>(dtype));
}

const char* op_name(int op) {
  switch (op) {
    case DDP_OP_SUM: return "sum";
    case DDP_OP_AVG: return "average";
    case DDP_OP_MAX: return "max";
    case DDP_OP_MIN: return "min";
  }
  return "?";
}

namespace {

// A NaN anywhere makes the max or min a NaN: a bad metric is never hidden.
template <class M>
M pick(M a, M b, bool max) {
  if (a != a) return a;
  if (b != b) return b;
  return max ? (b > a ? b : a) : (b < a ? b : a);
}

// Floats: load as the math type, accumulate in rank order, store once.
template <class T>
void reduce_float(const void* all, int world, size_t count, int op, void* out) {
  typedef typename T::storage S;
  typedef typename T::math M;
  const S* in = static_cast<const S*>(all);
  S* o = static_cast<S*>(out);
  for (size_t i = 0; i < count; ++i) {
    M acc = T::load(in[i]);
    for (int r = 1; r < world; ++r) {
      const M v = T::load(in[static_cast<size_t>(r) * count + i]);
      acc = op == DDP_OP_SUM || op == DDP_OP_AVG ? acc + v : pick(acc, v, op == DDP_OP_MAX);
    }
    if (op == DDP_OP_AVG) acc = static_cast<M>(acc / static_cast<M>(world));
    o[i] = T::store(acc);
  }
}

// Integers: sums in 128 bits, so an average is exact whatever the ranks' values (it always fits the
// type), and a sum that overflows the type wraps around (two's complement), as documented.
__extension__ typedef __int128 Wide;
__extension__ typedef unsigned __int128 UWide;

template <class I>
void reduce_int(const void* all, int world, size_t count, int op, void* out) {
  const I* in = static_cast<const I*>(all);
  I* o = static_cast<I*>(out);
  for (size_t i = 0; i < count; ++i) {
    Wide acc = in[i];
    for (int r = 1; r < world; ++r) {
      const Wide v = in[static_cast<size_t>(r) * count + i];
      if (op == DDP_OP_SUM || op == DDP_OP_AVG)
        acc += v;  // at most 2^31 ranks of 64-bit values: never overflows 128 bits
      else
        acc = op == DDP_OP_MAX ? (v > acc ? v : acc) : (v < acc ? v : acc);
    }
    if (op == DDP_OP_AVG) acc /= world;  // rounds toward zero
    // The low bits as the type: modular, never undefined (unsigned conversion, then two's complement).
    typedef typename std::make_unsigned<I>::type U;
    const U bits = static_cast<U>(static_cast<UWide>(acc));
    I value;
    std::memcpy(&value, &bits, sizeof value);
    o[i] = value;
  }
}

}  // namespace

void reduce_in_rank_order(const void* all, int world, size_t count, int dtype, int op, void* out) {
  switch (dtype) {
    case DDP_F16: return reduce_float<elem::F16>(all, world, count, op, out);
    case DDP_BF16: return reduce_float<elem::BF16>(all, world, count, op, out);
    case DDP_F32: return reduce_float<elem::F32>(all, world, count, op, out);
    case DDP_F64: return reduce_float<elem::F64>(all, world, count, op, out);
    case DDP_I32: return reduce_int<int32_t>(all, world, count, op, out);
    case DDP_I64: return reduce_int<int64_t>(all, world, count, op, out);
  }
  fail(DDP_ERR_INTERNAL, "reduce_in_rank_order: dtype %d", dtype);
}

}  // namespace ddp
