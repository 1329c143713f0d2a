// The host element loops of the compressed wires written with AVX2 and F16C, for x86-64 CPUs that
// have them: the f32 <-> fp16 / bf16 casts with a scale, the 16-bit sums of the host reductions, and
// the int8 wire's f32 blocks. Each gives the bits of the portable loops (kernels/elementwise.h) on
// every input, NaN payloads, denormals, ties and overflow included: every rank and the GPU kernels
// must agree on what crosses the wire, whichever path a rank takes. host_kernels.cpp chooses.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ddp {
namespace host {
namespace simd {

// Whether this CPU runs the functions below (AVX2 and F16C); false on other architectures, where
// the functions are never called.
bool supported();

// out[i] = Dst(in[i] * scale), the multiply (skipped when `unit`) in float: elem::scaled_cast.
void f32_to_f16(const float* in, uint16_t* out, size_t n, float scale, bool unit);
void f16_to_f32(const uint16_t* in, float* out, size_t n, float scale, bool unit);
void f32_to_bf16(const float* in, uint16_t* out, size_t n, float scale, bool unit);
void bf16_to_f32(const uint16_t* in, float* out, size_t n, float scale, bool unit);
// out[i] = (a[i] + b[i]) * scale in float, stored as fp16 / bf16: elem::sum_scaled. out may be a.
void sum_f16(const uint16_t* a, const uint16_t* b, uint16_t* out, size_t n, float scale, bool unit);
void sum_bf16(const uint16_t* a, const uint16_t* b, uint16_t* out, size_t n, float scale, bool unit);
// The int8 wire over f32 elements: host::int8_quantize_span and host::int8_dequant_sum_span (the
// elements [lo, lo + len) of chunks laid out for n; x, residual and out start at element lo).
void int8_quantize_f32(const float* x, float* residual, size_t n, size_t lo, size_t len, char* chunk);
void int8_dequant_sum_f32(const char* chunks, size_t chunk_bytes, int world, size_t n, size_t lo, size_t len,
                          float* out);

}  // namespace simd
}  // namespace host
}  // namespace ddp
