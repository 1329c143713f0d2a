// The bucket program (core/program.hpp) for every layout x dtype x shard x wire x backend x scaling
// combination, against rules restated here independently: which type travels, whether a bucket is
// staged, which collective, pieces, in-place grads, bytes on the wire, the shard's span, and that the
// scaling left as passes times the fused factor is always the one apex defines.
#include <doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "../support/int8_model.hpp"
#include "core/program.hpp"
#include "kernels/elementwise.h"

using namespace ddp;

namespace {

// A host engine (MPI, Gloo): sums f32/f64 natively, scales its own sums, cuts pieces.
Capabilities host_caps() {
  Capabilities c;
  c.wire[static_cast<int>(Dtype::F32)] = c.wire[static_cast<int>(Dtype::F64)] = true;
  c.sumscaled = c.alltoall = c.cast_ring = true;
  for (int d = 0; d < kNumDtypes; ++d) c.piece_elems[d] = (size_t(1) << 16) / dtype_size(static_cast<Dtype>(d));
  return c;
}

// NCCL: every type, ncclAvg, pre-multiplied sums, grouping, no pieces.
Capabilities nccl_caps() {
  Capabilities c;
  for (int d = 0; d < kNumDtypes; ++d) c.wire[d] = true;
  c.avg = c.premulsum = c.group = true;
  return c;
}

// Grads of every dtype, small and large, two of each.
std::vector<GradSpec> specs() {
  std::vector<GradSpec> s;
  const size_t sizes[] = {7, 100000, 300, 40000};
  for (int d = 0; d < kNumDtypes; ++d)
    for (size_t n : sizes) s.push_back(GradSpec{n + static_cast<size_t>(d), static_cast<Dtype>(d), 0});
  return s;
}

struct Case {
  bool nccl, arena, shard, always_fp32, average, hook;
  int compression;  // ddp_compression_t
  double predivide;
  int world, divisor;
};

std::string name(const Case& c) {
  return std::string(c.nccl ? "nccl" : "host") + (c.arena ? " arena" : " copy") + (c.shard ? " shard" : "") +
         (c.always_fp32 ? " fp32" : "") + (c.average ? " avg" : " sum") + (c.hook ? " hook" : "") + " compression " +
         std::to_string(c.compression) + " predivide " + std::to_string(c.predivide) + " world " +
         std::to_string(c.world) + " divisor " + std::to_string(c.divisor);
}

void check_case(const Case& c) {
  const std::vector<GradSpec> sp = specs();
  ProgramSettings s;
  s.world = c.world;
  s.rank = c.world - 1;
  s.arena = c.arena;
  s.shard = c.shard;
  s.always_fp32 = c.always_fp32;
  s.average = c.average;
  s.predivide = c.predivide;
  s.compress = c.compression == DDP_COMPRESS_BF16 || c.compression == DDP_COMPRESS_FP16;
  s.compress_wire = c.compression == DDP_COMPRESS_FP16 ? Dtype::F16 : Dtype::BF16;
  s.int8 = c.compression == DDP_COMPRESS_INT8;
  s.hook = c.hook;
  const Capabilities caps = c.nccl ? nccl_caps() : host_caps();
  const Plan plan = registration_plan(sp, 50000, 2);
  const Program p = compile_program(plan, sp, s, {caps, caps}, c.divisor);
  INFO(name(c) << "\n" << describe(p));
  REQUIRE(p.buckets.size() == plan.buckets.size());
  CHECK(p.group == (c.nccl && !c.hook && c.compression != DDP_COMPRESS_INT8));
  for (size_t i = 0; i < p.buckets.size(); ++i) {
    const Bucket& bk = plan.buckets[i];
    const BucketProgram& b = p.buckets[i];
    CHECK(b.dtype == bk.dtype);
    CHECK(b.numel == bk.numel);
    CHECK(b.stream == bk.stream);
    const bool wide = bk.dtype == Dtype::F32 || bk.dtype == Dtype::F64;
    // The wire: 16-bit grads as they are where the engine sums them (else fp32); wide ones compressed.
    Dtype wire = bk.dtype;
    if (!wide && (c.always_fp32 || !c.nccl)) wire = Dtype::F32;
    if (wide && s.compress) wire = s.compress_wire;
    const Collective want = c.hook             ? Collective::Hook
                            : (s.int8 && wide) ? Collective::Int8
                            : c.shard          ? Collective::ReduceScatter
                                               : Collective::AllReduce;
    CHECK(b.collective == want);
    // Host comms cast f32 buckets to the 16-bit wire inside the ring: the bucket is then an f32 one
    // whose ring sends 16 bits.
    const bool ring_cast = !c.nccl && s.compress && bk.dtype == Dtype::F32 && want == Collective::AllReduce;
    CHECK(b.ring_cast == ring_cast);
    const Dtype sent = wire;
    if (ring_cast) {
      CHECK(b.send == wire);
      wire = Dtype::F32;
    }
    CHECK(b.wire == wire);
    CHECK(b.staged == (!c.arena || wire != bk.dtype));
    // Pieces: host engines only, never for whole-bucket collectives.
    const bool whole = c.shard || c.hook || want == Collective::Int8;
    CHECK(b.piece == (whole ? 0 : caps.piece_elems[static_cast<int>(wire)]));
    // In place: copy layout, allreduce, no cast, at least one piece.
    size_t packed = 0, direct_bytes = 0;
    REQUIRE(b.direct.size() == bk.grads.size());
    for (size_t k = 0; k < bk.grads.size(); ++k) {
      const size_t n = sp[static_cast<size_t>(bk.grads[k])].numel;
      const bool direct = !c.arena && want == Collective::AllReduce && wire == bk.dtype && b.piece > 0 && n >= b.piece;
      CHECK(b.direct[k] == direct);
      if (direct)
        direct_bytes += n * dtype_size(bk.dtype);
      else
        packed += n;
    }
    CHECK(b.packed == packed);
    // The shard: equal, aligned shards covering the bucket.
    if (c.shard) {
      CHECK(b.padded >= b.numel);
      CHECK(b.padded % static_cast<size_t>(c.world) == 0);
      CHECK(b.shard_n * static_cast<size_t>(c.world) == b.padded);
      CHECK((b.shard_n * dtype_size(bk.dtype)) % 256 == 0);
      const size_t lo = static_cast<size_t>(s.rank) * b.shard_n;
      if (b.staged)
        CHECK((b.out.lo == std::min(packed, lo) && b.out.hi == std::min(packed, lo + b.shard_n)));
      else
        CHECK((b.out.lo == lo && b.out.hi == lo + b.shard_n));
    } else {
      CHECK(b.padded == b.numel);
      CHECK(b.shard_n == 0);
      CHECK((b.out.lo == 0 && b.out.hi == (b.staged ? packed : b.numel)));
    }
    // Staging and the bytes on the wire.
    const size_t staged_elems = c.shard ? b.padded : packed;
    CHECK(b.stage_bytes == (b.staged ? staged_elems * dtype_size(wire) : 0));
    uint64_t bytes = b.staged ? staged_elems * dtype_size(wire) + direct_bytes : b.padded * dtype_size(bk.dtype);
    if (want == Collective::Int8) bytes = elem::int8_chunk_bytes(b.numel);
    if (ring_cast) bytes = (packed + direct_bytes / dtype_size(bk.dtype)) * dtype_size(sent);
    CHECK(b.wire_bytes == bytes);
    // int8: a reduce-scatter from world 3 where the comm has an all-to-all (host comms), each rank's
    // chunk then as large as the largest shard's; else an all-gather of whole chunks (on host comms in
    // rounds of the host piece).
    const bool scatter = want == Collective::Int8 && !c.nccl && int8_model::scatters(b.numel, c.world, 3);
    CHECK(b.int8_scatter == scatter);
    size_t chunk = want == Collective::Int8 ? bytes : 0;
    if (scatter) {
      size_t most = 0;
      for (int j = 0; j < c.world; ++j)
        most = std::max(most, int8_shard(b.numel, c.world, j).hi - int8_shard(b.numel, c.world, j).lo);
      chunk = elem::int8_chunk_bytes(most);
    }
    // The host all-gather goes in rounds of the host piece (whole blocks) when the bucket is larger.
    const size_t round = caps.piece_elems[static_cast<int>(Dtype::F32)] / 256 * 256;
    const bool rounds = want == Collective::Int8 && !scatter && round > 0 && b.numel > round;
    CHECK(b.int8_piece == (rounds ? round : 0));
    if (rounds) chunk = elem::int8_chunk_bytes(round);
    CHECK(b.int8_chunk == chunk);
    // Scaling: whatever is fused, pre x fused x post is apex's (1/f) x (f/divisor), or 1/f unaveraged;
    // with a hook 1 (the hook scales, as in torch DDP).
    const double want_factor = c.hook ? 1.0 : (1.0 / c.predivide) * (c.average ? c.predivide / c.divisor : 1.0);
    double fused = 1.0;
    if (b.red.op == RedOp::Avg) fused = 1.0 / c.world;
    if (b.red.op == RedOp::PreMulSum || b.red.op == RedOp::SumScaled) fused = b.red.factor;
    CHECK(std::fabs(b.pre * fused * b.post - want_factor) <= 1e-15 * want_factor);
    // What each engine fuses: never anything with a hook or int8; NCCL's Avg only over the whole world.
    if (c.hook || want == Collective::Int8) CHECK(b.red.op == RedOp::Sum);
    if (c.hook) CHECK((b.pre == 1.0 && b.post == 1.0));
    if (b.red.op == RedOp::Avg) CHECK((c.nccl && c.divisor == c.world && c.predivide == 1.0 && c.average));
    if (b.red.op == RedOp::SumScaled) CHECK_FALSE(c.nccl);
    if (b.red.op == RedOp::PreMulSum) {
      CHECK(c.nccl);
      // A 16-bit premultiplied sum only with a factor 16 bits hold exactly (1/3 is not).
      if (is_16bit(wire)) CHECK(c.predivide != 3.0);
    }
  }
}

}  // namespace

TEST_CASE("program: every layout x shard x wire x backend x scaling against the rules") {
  int cases = 0;
  for (bool nccl : {false, true})
    for (bool arena : {false, true})
      for (bool shard : {false, true})
        for (bool fp32 : {false, true})
          for (bool average : {false, true})
            for (bool hook : {false, true})
              for (int compression = 0; compression <= 3; ++compression)
                for (double predivide : {1.0, 2.0, 3.0})
                  for (int world : {1, 3, 4})
                    for (int divisor : {world, world - 1}) {
                      if (shard && !arena) continue;                 // refused by ddp_create
                      if (hook && (shard || compression)) continue;  // refused by ddp_set_comm_hook
                      if (compression == DDP_COMPRESS_INT8 && shard) continue;
                      if (divisor < 1) continue;
                      check_case(Case{nccl, arena, shard, fp32, average, hook, compression, predivide, world, divisor});
                      ++cases;
                    }
  CHECK(cases > 1000);
}

TEST_CASE("program: a divisor change re-derives the scaling and nothing else") {
  const std::vector<GradSpec> sp = specs();
  ProgramSettings s;
  s.world = 4;
  const Plan plan = registration_plan(sp, 50000, 1);
  for (const Capabilities& caps : {host_caps(), nccl_caps()}) {
    Program p = compile_program(plan, sp, s, {caps}, 4);
    const Program fresh3 = compile_program(plan, sp, s, {caps}, 3);
    rescale_program(p, s, {caps}, 3);
    CHECK(describe(p) == describe(fresh3));
    rescale_program(p, s, {caps}, 4);
    CHECK(describe(p) == describe(compile_program(plan, sp, s, {caps}, 4)));
  }
}

TEST_CASE("program: the programs of two common set-ups, line by line") {
  const std::vector<GradSpec> sp = {{1000, Dtype::F32, 0}, {70000, Dtype::F32, 0}, {10, Dtype::BF16, 0}};
  ProgramSettings s;
  s.world = 2;
  const Plan plan = registration_plan(sp, 50000, 1);
  // Host memory, copy layout, averaging: the ring scales its own sums; the grad of 70000 elements
  // (more than a piece) goes in place; bf16 travels as f32 (MPI cannot sum it).
  CHECK(describe(compile_program(plan, sp, s, {host_caps()}, 2)) ==
        "b0 s0 f32>f32 staged allreduce n=70000 padded=70000 shard=0 packed=0 direct=1 piece=16384 "
        "red=sumscaled:0.5 pre=1 post=1 out=0..0 stage=0 wire_bytes=280000\n"
        "b1 s0 bf16>f32 staged allreduce n=10 padded=10 shard=0 packed=10 direct=0 piece=16384 red=sumscaled:0.5 "
        "pre=1 post=1 out=0..10 stage=40 wire_bytes=40\n"
        "b2 s0 f32>f32 staged allreduce n=1000 padded=1000 shard=0 packed=1000 direct=0 piece=16384 "
        "red=sumscaled:0.5 pre=1 post=1 out=0..1000 stage=4000 wire_bytes=4000\n");
  // NCCL, arena, sharded, predivide 2: reduce-scatter in place with a premultiplied sum; shards of
  // 256-byte multiples (70000 f32 -> 2 x 35008).
  s.arena = s.shard = true;
  s.predivide = 2.0;
  CHECK(describe(compile_program(plan, sp, s, {nccl_caps()}, 2)) ==
        "b0 s0 f32>f32 in-place reduce-scatter n=70000 padded=70016 shard=35008 packed=70000 direct=0 piece=0 "
        "red=premulsum:0.5 pre=1 post=1 out=0..35008 stage=0 wire_bytes=280064 grouped\n"
        "b1 s0 bf16>bf16 in-place reduce-scatter n=10 padded=256 shard=128 packed=10 direct=0 piece=0 "
        "red=premulsum:0.5 pre=1 post=1 out=0..128 stage=0 wire_bytes=512 grouped\n"
        "b2 s0 f32>f32 in-place reduce-scatter n=1000 padded=1024 shard=512 packed=1000 direct=0 piece=0 "
        "red=premulsum:0.5 pre=1 post=1 out=0..512 stage=0 wire_bytes=4096 grouped\n");
}

TEST_CASE("int8 shards: whole blocks, in order, covering the bucket, as even as blocks allow") {
  for (size_t n : {size_t(1), size_t(255), size_t(256), size_t(257), size_t(1000), size_t(4096), size_t(100003)})
    for (int w = 1; w <= 9; ++w) {
      INFO("n " << n << " world " << w);
      const size_t blocks = elem::int8_blocks(n);
      size_t at = 0, least = SIZE_MAX, most = 0;
      for (int j = 0; j < w; ++j) {
        const Span sh = int8_shard(n, w, j);
        CHECK(sh.lo == at);
        CHECK(sh.hi >= sh.lo);
        CHECK((sh.lo % elem::kInt8Block == 0));
        CHECK((sh.hi == n || sh.hi % elem::kInt8Block == 0));
        const size_t b = elem::int8_blocks(sh.hi) - elem::int8_blocks(sh.lo);
        least = std::min(least, b);
        most = std::max(most, b);
        at = sh.hi;
      }
      CHECK(at == n);
      CHECK(most - least <= 1);
      CHECK(most == (blocks + static_cast<size_t>(w) - 1) / static_cast<size_t>(w));
    }
}
