// The host element loops: casting with a scale (pack, unpack, the averaging pass) and the finiteness
// scan, over host memory.
#pragma once

#include <cstddef>

#include "core/common.hpp"

namespace ddp {
namespace host {

// dst[i] = (D)(src[i] * scale) for n elements, in the precision elem::scaled_cast defines; src == dst
// is allowed when s == d.
void convert(const void* src, Dtype s, void* dst, Dtype d, size_t n, double scale);
// out[i] = (a[i] + b[i]) * scale for n elements (elem::sum_scaled; a scale of 1 is a plain sum). out
// may be a; b overlaps neither.
void sum_scaled(const void* a, const void* b, void* out, size_t n, Dtype d, double scale);
// The 16-bit wires cast inside the host ring (the partial sums stay f32, only the bytes on the wire
// are 16 bits): out[i] = (a[i] + f32(b[i])) * scale in f32 math, each step rounded, for b in the
// 16-bit `wire` (a scale of 1 is a plain sum; out may be a). With `bits`, out[i] is then rounded to
// the wire's precision, and its 16 bits are written to bits[i].
void add_widened(const float* a, const void* b, Dtype wire, float* out, size_t n, double scale, void* bits);
// out[i] = f32(wire(in[i] * scale)): a value as it comes out of a 16-bit wire (in may be out).
void round_through(const float* in, float* out, size_t n, Dtype wire, double scale);
// The int8 wire (elem::int8_quantize_block): x's n elements (F32 or F64) plus `residual` into the
// chunk of elem::int8_chunk_bytes(n) bytes, block after block; residual becomes what was not sent.
void int8_quantize(const void* x, Dtype d, size_t n, float* residual, void* chunk);
// out[i] = the sum over `world` chunks, chunk_bytes apart, of q * scale, in rank order, in d's math.
void int8_dequant_sum(const void* chunks, size_t chunk_bytes, int world, size_t n, Dtype d, void* out);
// The same for the elements [lo, lo + len) of chunks laid out for n elements (lo a multiple of
// elem::kInt8Block; so is len unless the span ends the chunk): x, residual and out hold the span's
// elements only. The bits are those of the whole chunk's calls.
void int8_quantize_span(const void* x, Dtype d, size_t n, size_t lo, size_t len, float* residual, void* chunk);
void int8_dequant_sum_span(const void* chunks, size_t chunk_bytes, int world, size_t n, size_t lo, size_t len, Dtype d,
                           void* out);
// Whether any of the n elements is an infinity or a NaN.
bool has_nonfinite(const void* buf, size_t n, Dtype d);

// Whether the loops above take their AVX2 / F16C versions (host/host_simd.hpp) for f32 <-> fp16 and
// bf16 casts, the 16-bit sums and the int8 wire's f32 blocks: the CPU has both extensions and
// DDP_HOST_SIMD is not 0. Chosen at the first call and kept; both paths give the same bits.
bool simd_path();
// Forgets that choice, so that the next call reads DDP_HOST_SIMD and the CPU again: for tests that
// compare both paths in one process.
void choose_simd_path_again();

}  // namespace host
}  // namespace ddp
