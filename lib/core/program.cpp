#include "core/program.hpp"

#include <algorithm>

#include "kernels/elementwise.h"

namespace ddp {

namespace {

// Whether `f` is exactly a value of the 16-bit type `d`.
bool exact_in(Dtype d, double f) {
  const float x = static_cast<float>(f);
  if (static_cast<double>(x) != f) return false;
  const float y = d == Dtype::F16 ? elem::f16_to_f32(elem::f32_to_f16(x)) : elem::bf16_to_f32(elem::f32_to_bf16(x));
  return y == x;
}

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::AllReduce: return "allreduce";
    case Collective::ReduceScatter: return "reduce-scatter";
    case Collective::Hook: return "hook";
    case Collective::Int8: return "int8";
  }
  return "?";
}

const char* op_name(RedOp op) {
  switch (op) {
    case RedOp::Sum: return "sum";
    case RedOp::Avg: return "avg";
    case RedOp::PreMulSum: return "premulsum";
    case RedOp::SumScaled: return "sumscaled";
  }
  return "?";
}

// Sharded buckets are padded to a multiple of world shards of a multiple of 256 bytes each, so that
// every shard has the same size and an aligned start.
size_t padded_numel(const ProgramSettings& s, const Bucket& bk) {
  if (!s.shard) return bk.numel;
  const size_t unit = static_cast<size_t>(s.world) * std::max<size_t>(1, 256 / dtype_size(bk.dtype));
  return (bk.numel + unit - 1) / unit * unit;
}

// Scaling (apex): multiply by 1/f before the sum, by f/divisor after it (or not at all without
// averaging). Fused into the collective where the engine can: ncclAvg, a pre-multiplied sum, or a sum
// the engine scales itself (the host ring). The int8 wire only sums: both factors stay passes of
// their own (folded into pack and unpack). A comm hook scales itself, as in torch DDP: the library
// applies neither factor, and what the hook leaves is the result.
void scaling(BucketProgram& b, const ProgramSettings& s, const Capabilities& c, int divisor) {
  b.red = Reduction{};
  const bool hook = b.collective == Collective::Hook;
  b.pre = hook ? 1.0 : 1.0 / s.predivide;
  b.post = hook ? 1.0 : s.average ? s.predivide / divisor : 1.0;
  if (hook || b.collective == Collective::Int8) return;
  if (s.average && s.predivide == 1.0 && divisor == s.world && c.avg) {
    b.red = Reduction{RedOp::Avg, 1.0};
    b.post = 1.0;
  } else if (b.pre != 1.0 && c.premulsum) {
    // A premultiplied sum on a 16-bit wire multiplies by the factor in 16 bits: one that 16 bits
    // cannot hold exactly (1/3) would bias every grad. Then it stays a pass in fp32 math, one
    // rounding per element, as apex's pre-division is.
    if (!is_16bit(b.wire) || exact_in(b.wire, b.pre)) {
      b.red = Reduction{RedOp::PreMulSum, b.pre};
      b.pre = 1.0;
    }
  } else if (b.post != 1.0 && c.sumscaled) {
    b.red = Reduction{RedOp::SumScaled, b.post};
    b.post = 1.0;
  }
}

// The int8 wire's exchange. A reduce-scatter where the comm can exchange with every rank, the world
// reaches DDP_INT8_SCATTER_MIN_WORLD, and (from 3 ranks) the bucket gains from it: its largest
// shard's chunk, sent twice, below the whole chunk the all-gather sends (fewer than about 2 x world
// blocks do not gain). Below 3 ranks it never saves bytes and runs only where the knob asks for it.
// Each rank's chunk then holds a shard (the largest decides its size). Otherwise the all-gather, in
// rounds of the host piece (whole blocks) so that quantizing the next round and summing the last
// overlap the transfer of this one; a chunk then holds one round.
void int8_exchange(BucketProgram& b, const ProgramSettings& s, const Capabilities& c) {
  size_t shard = 0;
  for (int j = 0; j < s.world; ++j) {
    const Span sh = int8_shard(b.numel, s.world, j);
    shard = std::max(shard, sh.hi - sh.lo);
  }
  const bool gains = 2 * elem::int8_chunk_bytes(shard) < elem::int8_chunk_bytes(b.numel);
  b.int8_scatter = c.alltoall && s.world >= std::max(1, s.int8_scatter_min_world) && (s.world < 3 || gains);
  size_t most = b.int8_scatter ? shard : b.numel;
  const size_t piece = c.piece_elems[static_cast<int>(Dtype::F32)] / elem::kInt8Block * elem::kInt8Block;
  if (!b.int8_scatter && piece > 0 && b.numel > piece) {
    b.int8_piece = piece;
    most = piece;
  }
  b.int8_chunk = elem::int8_chunk_bytes(most);
}

// The type the collective sums: 16-bit grads as they are where the engine sums them (else f32);
// f32 and f64 ones compressed (every host comm sums 16 bits). Host comms cast f32 inside the ring: the
// bucket is then reduced as an f32 one (in place, in pieces, its large grads direct) with only the
// bytes on the wire in 16 bits.
void choose_wire(BucketProgram& b, const ProgramSettings& s, const Capabilities& c) {
  const bool wide = !is_16bit(b.dtype);
  b.wire = !wide && (s.always_fp32 || !c.wire[static_cast<int>(b.dtype)]) ? Dtype::F32 : b.dtype;
  if (s.compress && wide) b.wire = s.compress_wire;
  b.ring_cast = s.compress && b.dtype == Dtype::F32 && c.cast_ring && !s.shard && !s.hook && !s.int8;
  if (b.ring_cast) {
    b.send = b.wire;
    b.wire = Dtype::F32;
  }
}

BucketProgram compile_bucket(const Bucket& bk, const std::vector<GradSpec>& specs, const ProgramSettings& s,
                             const Capabilities& c, int divisor) {
  BucketProgram b;
  b.stream = bk.stream;
  b.dtype = bk.dtype;
  b.numel = bk.numel;
  const bool wide = !is_16bit(bk.dtype);
  choose_wire(b, s, c);
  b.collective = s.hook             ? Collective::Hook
                 : (s.int8 && wide) ? Collective::Int8
                 : s.shard          ? Collective::ReduceScatter
                                    : Collective::AllReduce;
  b.staged = !s.arena || b.wire != bk.dtype;
  b.padded = padded_numel(s, bk);
  b.shard_n = s.shard ? b.padded / static_cast<size_t>(s.world) : 0;
  // Sharded buckets go whole to the comm's reduce-scatter, which cuts its own pieces; a hook and the
  // int8 wire take the whole bucket in one buffer.
  const bool whole = s.shard || b.collective == Collective::Hook || b.collective == Collective::Int8;
  b.piece = whole ? 0 : c.piece_elems[static_cast<int>(b.wire)];
  // inplace_min_numel 0 is the library's choice: on host comms a grad of at least one piece goes in
  // place (its pieces skip the pack and unpack passes: measured faster); elsewhere never.
  const size_t inplace = s.inplace_min_numel ? s.inplace_min_numel : b.piece;
  const bool may_direct = !s.arena && b.wire == bk.dtype && inplace > 0 && b.collective == Collective::AllReduce;
  uint64_t direct_bytes = 0;
  for (int g : bk.grads) {
    const size_t n = specs[static_cast<size_t>(g)].numel;
    b.direct.push_back(may_direct && n >= inplace);
    if (b.direct.back())
      direct_bytes += n * dtype_size(bk.dtype);
    else
      b.packed += n;
  }
  const size_t lo = s.shard ? static_cast<size_t>(s.rank) * b.shard_n : 0;
  if (b.staged) {
    // Sharded: the staging buffer holds the padded bucket (the reduce-scatter's chunks); only the
    // shard's packed elements are scanned after.
    b.stage_bytes = (s.shard ? b.padded : b.packed) * dtype_size(b.wire);
    b.out = s.shard ? Span{std::min(b.packed, lo), std::min(b.packed, lo + b.shard_n)} : Span{0, b.packed};
  } else {
    b.out = s.shard ? Span{lo, lo + b.shard_n} : Span{0, b.numel};
  }
  if (b.collective == Collective::Int8) {
    int8_exchange(b, s, c);
    b.wire_bytes = elem::int8_chunk_bytes(b.numel);  // the payload, whatever the collectives
  } else if (b.ring_cast) {
    b.wire_bytes = (b.packed + direct_bytes / dtype_size(bk.dtype)) * dtype_size(b.send);
  } else if (b.staged) {
    b.wire_bytes = b.stage_bytes + direct_bytes;
  } else {
    b.wire_bytes = b.padded * dtype_size(bk.dtype);
  }
  scaling(b, s, c, divisor);
  return b;
}

}  // namespace

Span int8_shard(size_t n, int world, int j) {
  const size_t blocks = elem::int8_blocks(n), w = static_cast<size_t>(world), k = static_cast<size_t>(j);
  return Span{std::min(n, blocks * k / w * elem::kInt8Block), std::min(n, blocks * (k + 1) / w * elem::kInt8Block)};
}

Capabilities Capabilities::of(const Comm& c, size_t piece_bytes, bool inline_streams) {
  Capabilities k;
  for (int d = 0; d < kNumDtypes; ++d) {
    k.wire[d] = c.supports_wire(static_cast<Dtype>(d));
    k.piece_elems[d] = c.piece_elems(static_cast<Dtype>(d), piece_bytes);
  }
  k.avg = c.supports(RedOp::Avg);
  k.premulsum = c.supports(RedOp::PreMulSum);
  k.sumscaled = c.supports(RedOp::SumScaled);
  k.group = c.can_group() && inline_streams;
  k.alltoall = c.has_alltoall();
  k.cast_ring = c.can_cast_ring();
  return k;
}

Program compile_program(const Plan& plan, const std::vector<GradSpec>& specs, const ProgramSettings& s,
                        const std::vector<Capabilities>& caps, int divisor) {
  Program p;
  for (const Bucket& bk : plan.buckets)
    p.buckets.push_back(compile_bucket(bk, specs, s, caps.at(static_cast<size_t>(bk.stream)), divisor));
  // Grouping interleaves several buckets' steps on the launching thread: GPU streams only; not around
  // a hook, which the caller may make block, nor the int8 wire, whose collective step runs kernels
  // before and after its all-gather (inside a group the all-gather would run after both).
  p.group = !caps.empty() && caps[0].group && !s.hook && !s.int8;
  return p;
}

void rescale_program(Program& p, const ProgramSettings& s, const std::vector<Capabilities>& caps, int divisor) {
  for (BucketProgram& b : p.buckets) scaling(b, s, caps.at(static_cast<size_t>(b.stream)), divisor);
}

std::string describe(const Program& p) {
  std::string out;
  for (size_t i = 0; i < p.buckets.size(); ++i) {
    const BucketProgram& b = p.buckets[i];
    size_t direct = 0;
    for (bool d : b.direct) direct += d ? 1 : 0;
    out += format(
        "b%zu s%d %s>%s %s %s n=%zu padded=%zu shard=%zu packed=%zu direct=%zu piece=%zu red=%s:%g pre=%g "
        "post=%g out=%zu..%zu stage=%zu wire_bytes=%llu%s%s%s\n",
        i, b.stream, dtype_name(b.dtype), dtype_name(b.wire), b.staged ? "staged" : "in-place",
        collective_name(b.collective), b.numel, b.padded, b.shard_n, b.packed, direct, b.piece, op_name(b.red.op),
        b.red.factor, b.pre, b.post, b.out.lo, b.out.hi, b.stage_bytes, static_cast<unsigned long long>(b.wire_bytes),
        b.int8_scatter ? " scatter" : "", b.ring_cast ? (b.send == Dtype::F16 ? " send=f16" : " send=bf16") : "",
        p.group ? " grouped" : "");
  }
  return out;
}

// What the bucket programs are compiled from: the config's values, read here and nowhere else.
ProgramSettings program_settings(const Settings& cfg, int world, int rank, bool hook) {
  ProgramSettings ps;
  ps.world = world;
  ps.rank = rank;
  ps.shard = cfg.sharded();
  ps.arena = cfg.arena();
  ps.always_fp32 = cfg.c.allreduce_always_fp32 != 0;
  ps.average = cfg.c.gradient_average != 0;
  ps.predivide = cfg.c.gradient_predivide_factor;
  ps.inplace_min_numel = cfg.c.inplace_min_numel;
  ps.piece_bytes = cfg.c.host_piece_bytes;
  ps.compress = cfg.c.compression == DDP_COMPRESS_BF16 || cfg.c.compression == DDP_COMPRESS_FP16;
  ps.compress_wire = cfg.c.compression == DDP_COMPRESS_FP16 ? Dtype::F16 : Dtype::BF16;
  ps.int8 = cfg.c.compression == DDP_COMPRESS_INT8;
  ps.int8_scatter_min_world = cfg.int8_scatter_min_world;
  ps.hook = hook;
  return ps;
}

}  // namespace ddp
