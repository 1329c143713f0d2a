// The bucket program: what each bucket's reduction does, decided once when a plan is adopted, from the
// plan, the settings and what the backends can do. The reducer only runs it, step by step; no step
// asks again whether a bucket is staged, sharded, compressed or hooked. Plain data: a unit test
// compares programs for every layout, dtype, shard, wire and backend (tests/unit/test_program.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/config.hpp"
#include "core/plan.hpp"

namespace ddp {

// The settings a program depends on.
struct ProgramSettings {
  int world = 1;
  int rank = 0;
  bool arena = false;
  bool shard = false;
  bool always_fp32 = false;
  bool average = true;
  double predivide = 1.0;
  size_t inplace_min_numel = 0;  // 0: the library's choice (one host piece), SIZE_MAX: never
  size_t piece_bytes = 0;
  bool compress = false;  // f32/f64 buckets travel as compress_wire
  Dtype compress_wire = Dtype::BF16;
  bool int8 = false;               // f32/f64 buckets travel as int8 blocks
  int int8_scatter_min_world = 3;  // from this world on, the int8 wire reduce-scatters (knobs.hpp)
  bool hook = false;               // a comm hook sums every bucket
};

// What the backends can do, asked once per stream's communicator.
// What the bucket programs are compiled from: the config's values (config.hpp), read there and
// nowhere else, with the world and this rank's place in it.
ProgramSettings program_settings(const Settings& cfg, int world, int rank, bool hook);

struct Capabilities {
  bool wire[kNumDtypes] = {};  // the engine sums this type natively
  bool avg = false, premulsum = false, sumscaled = false;
  size_t piece_elems[kNumDtypes] = {};  // host pieces per wire type (0: whole buckets)
  bool group = false;                   // several buckets' collectives as one group (GPU streams)
  bool alltoall = false;                // Comm::alltoall (the int8 wire's reduce-scatter)
  bool cast_ring = false;               // Comm::allreduce_as (16-bit wires cast inside the ring)
  static Capabilities of(const Comm& c, size_t piece_bytes, bool inline_streams);
};

// The collective a bucket's buffer goes through.
enum class Collective { AllReduce, ReduceScatter, Hook, Int8 };

struct BucketProgram {
  int stream = 0;
  Dtype dtype = Dtype::F32;  // the grads'
  Dtype wire = Dtype::F32;   // what the collective sums (int8: the grads' type, quantized inside)
  // Host comms: an f32 bucket on a 16-bit wire sums in f32 (wire F32) and sends `send` (the 16-bit
  // type) inside the ring (Comm::allreduce_as): no pass casts the whole bucket in or out.
  bool ring_cast = false;
  Dtype send = Dtype::F32;
  // Staged: the grads are packed (cast, pre-scaled) into a staging buffer and unpacked after; else
  // the collective runs on the bucket's own arena storage, scaled in place.
  bool staged = false;
  Collective collective = Collective::AllReduce;
  size_t numel = 0;              // the grads' elements
  size_t padded = 0;             // with the shard padding (sharded), else numel
  size_t shard_n = 0;            // per rank's shard (sharded), else 0
  size_t packed = 0;             // staged: elements packed (the rest go in place, each its own collective)
  std::vector<bool> direct;      // per slot: reduced in place, not packed (copy layout, large grads)
  size_t piece = 0;              // host pieces: every pass fused per piece (0: the bucket whole)
  Reduction red;                 // what the collective fuses
  double pre = 1.0, post = 1.0;  // the scaling left as passes (folded into pack and unpack)
  Span out;                      // the elements scaled (in place) or scanned after: the shard, or all
  size_t stage_bytes = 0;        // staging this bucket needs (bytes)
  size_t int8_chunk = 0;         // Int8: bytes of each rank's chunk (scatter: of each shard's, the largest)
  bool int8_scatter = false;     // Int8: reduce-scatter of int8 shards, re-quantize, all-gather
  size_t int8_piece = 0;         // Int8 all-gather: elements per round (whole blocks; 0: the bucket whole)
  uint64_t wire_bytes = 0;       // bytes given to collectives per reduction (ddp_stats_t.bytes_reduced)
};

struct Program {
  std::vector<BucketProgram> buckets;
  bool group = false;  // buckets launched together go as one group, their steps interleaved
};

// The int8 wire's reduce-scatter cuts a bucket of n elements into `world` shards of whole int8 blocks
// (elem::kInt8Block): shard j's elements, [lo, hi). A rank's shard may be empty (n below world blocks).
Span int8_shard(size_t n, int world, int j);

// Compiles the program of `plan` (caps: one per stream). `divisor` is the averaging's (the world, or
// the contributing ranks with uneven inputs).
Program compile_program(const Plan& plan, const std::vector<GradSpec>& specs, const ProgramSettings& s,
                        const std::vector<Capabilities>& caps, int divisor);

// Re-derives every bucket's scaling for a new divisor (uneven inputs); nothing else changes.
void rescale_program(Program& p, const ProgramSettings& s, const std::vector<Capabilities>& caps, int divisor);

// One line per bucket, for tests and DDP_DEBUG: "b0 s0 f32>bf16 staged allreduce n=… red=… pre=… post=…".
std::string describe(const Program& p);

}  // namespace ddp
