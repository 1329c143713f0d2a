// The reduction of ddp_allreduce_host: every rank's buffer, gathered, reduced in rank order on each
// rank, so that every rank computes the same bits. Floats accumulate in their own precision (16-bit
// types in fp32 math, rounded once at the end), integers in 64 bits.
#pragma once

#include <cstddef>

#include "core/common.hpp"

namespace ddp {

// Whether ddp_allreduce_host takes `dtype` (the grad types and DDP_I32, DDP_I64), and its size.
bool host_dtype_valid(int dtype);
size_t host_dtype_size(int dtype);
const char* host_dtype_name(int dtype);
const char* op_name(int op);

// out[i] = op over r in 0..world-1 of all[r * count + i], for `count` elements of `dtype` (`all`
// holds world buffers one after another). DDP_OP_AVG divides the sum by world (integers: toward
// zero). out may not overlap all.
void reduce_in_rank_order(const void* all, int world, size_t count, int dtype, int op, void* out);

}  // namespace ddp
