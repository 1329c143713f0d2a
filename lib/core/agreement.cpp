#include "core/agreement.hpp"

#include <algorithm>
#include <cstring>
#include <iterator>

#include "core/host_reduce.hpp"
#include "core/knobs.hpp"

namespace ddp {

namespace {

struct ConfigSummary {
  AgreedFields fields;
  int32_t device_memory;  // 1: device memory (NCCL), 0: host memory
  int32_t pad;
  int64_t wire_knobs[knobs::kNumWireKnobs];  // host memory: the values of the knobs on the wire
};

struct RegSummary {
  int32_t kind;  // kRegistration (a call record's size and first field)
  int32_t hook;  // 1: a comm hook is set (every rank sets one, or none)
  int64_t num_grads;
  uint64_t hash;
  unsigned char pad[kCallRecordBytes - 24];
};
static_assert(sizeof(RegSummary) == kCallRecordBytes, "the registration check travels as a call record");

struct RegEntry {
  uint64_t numel;
  uint32_t dtype, flags;
};

// A rank's first grad that differs from rank 0's list (index -1: none) and its own grad count.
struct FirstDiff {
  int64_t index;
  RegEntry entry;
  int64_t count;
};

uint64_t registration_hash(const std::vector<GradSpec>& specs) {
  Digest d;  // over (numel, dtype | flags << 8) of every grad
  for (const GradSpec& s : specs) {
    d.mix(s.numel);
    d.mix(static_cast<uint64_t>(s.dtype) | (static_cast<uint64_t>(s.flags) << 8));
  }
  return d.h;
}

RegEntry entry_of(const GradSpec& s) { return RegEntry{s.numel, static_cast<uint32_t>(s.dtype), s.flags}; }

bool same_entry(const RegEntry& a, const RegEntry& b) {
  return a.numel == b.numel && a.dtype == b.dtype && a.flags == b.flags;
}

FirstDiff compare_with(const std::vector<RegEntry>& ref, const std::vector<GradSpec>& specs) {
  FirstDiff d{-1, RegEntry{0, 0, 0}, static_cast<int64_t>(specs.size())};
  const size_t common = std::min(ref.size(), specs.size());
  for (size_t i = 0; i < common; ++i) {
    RegEntry e = entry_of(specs[i]);
    if (!same_entry(e, ref[i])) return FirstDiff{static_cast<int64_t>(i), e, d.count};
  }
  if (specs.size() != ref.size()) d.index = static_cast<int64_t>(common);
  return d;
}

// Names the earliest difference of any rank, identically on every rank.
[[noreturn]] void report_difference(const std::vector<RegEntry>& ref, const std::vector<FirstDiff>& diffs) {
  int worst = -1;
  for (size_t r = 1; r < diffs.size(); ++r)
    if (diffs[r].index >= 0 && (worst < 0 || diffs[r].index < diffs[static_cast<size_t>(worst)].index))
      worst = static_cast<int>(r);
  if (worst < 0) fail(DDP_ERR_MISMATCH, "ranks registered different grads (their signatures differ)");
  const FirstDiff& d = diffs[static_cast<size_t>(worst)];
  const size_t i = static_cast<size_t>(d.index), n0 = ref.size();
  if (i >= n0 || i >= static_cast<size_t>(d.count))
    fail(DDP_ERR_MISMATCH,
         "ranks registered different grads: rank %d registered %lld grads but rank 0 registered %zu (the first "
         "%zu agree)",
         worst, static_cast<long long>(d.count), n0, std::min(n0, static_cast<size_t>(d.count)));
  fail(DDP_ERR_MISMATCH,
       "ranks registered different grads: grad %zu is %s[%llu] (flags 0x%x) on rank 0 but %s[%llu] (flags 0x%x) "
       "on rank %d",
       i, dtype_name(static_cast<Dtype>(ref[i].dtype)), static_cast<unsigned long long>(ref[i].numel), ref[i].flags,
       dtype_name(static_cast<Dtype>(d.entry.dtype)), static_cast<unsigned long long>(d.entry.numel), d.entry.flags,
       worst);
}

// Names the ranks on each side, identically on every rank.
[[noreturn]] void report_hook_difference(const std::vector<RegSummary>& all) {
  std::vector<int> with, without;
  for (size_t r = 0; r < all.size(); ++r) (all[r].hook ? with : without).push_back(static_cast<int>(r));
  fail(DDP_ERR_MISMATCH,
       "ranks disagree on the comm hook: %s set one (ddp_set_comm_hook) but %s did not; every rank must set "
       "one, or none",
       rank_list(with).c_str(), rank_list(without).c_str());
}

// A knob on the wire (knobs::wire_knobs) that differs from rank 0's, named, on every rank alike.
void check_wire_knobs(const std::vector<ConfigSummary>& all) {
  knobs::WireKnob names[knobs::kNumWireKnobs];
  knobs::wire_knobs(names);
  for (int k = 0; k < knobs::kNumWireKnobs; ++k)
    for (size_t r = 1; r < all.size(); ++r)
      if (all[r].wire_knobs[k] != all[0].wire_knobs[k])
        fail(DDP_ERR_MISMATCH,
             "ranks disagree on the environment: %s is %lld on rank 0 but %lld on rank %zu (it sizes what crosses "
             "the wire: set it alike on every rank, or on none)",
             names[k].name, static_cast<long long>(all[0].wire_knobs[k]), static_cast<long long>(all[r].wire_knobs[k]),
             r);
}

}  // namespace

std::string describe_call(const void* record) {
  CallRecord r;
  std::memcpy(&r, record, sizeof r);
  switch (r.kind) {
    case kVote:
      return !r.flag     ? "ddp_join"
             : r.op == 1 ? "a synced iteration of ddp_reduce_all"
                         : "a synced iteration (ddp_begin_backward)";
    case kHostAllreduce:
      return format("ddp_allreduce_host(%llu elements of %s, %s)", static_cast<unsigned long long>(r.count),
                    host_dtype_name(r.dtype), op_name(r.op));
    case kBarrier: return "ddp_barrier";
    case kBroadcast: return format("ddp_broadcast(%d buffer%s from root %d)", r.dtype, r.dtype == 1 ? "" : "s", r.op);
    case kShardNorm: return "ddp_shard_norm";
    case kRegistration: return "the registration check (ddp_commit, or the first backward pass or ddp_reduce_all)";
    case kIterationEnd: return "the end of a synced iteration (ddp_finish_backward or ddp_reduce_all)";
  }
  return format("an unknown call (%d)", r.kind);
}

void check_same_call_kind(const void* all, int world, int me) {
  const unsigned char* bytes = static_cast<const unsigned char*>(all);
  const void* mine = bytes + static_cast<size_t>(me) * kCallRecordBytes;
  int32_t my_kind = 0, kind = 0;
  std::memcpy(&my_kind, mine, sizeof my_kind);
  for (int r = 0; r < world; ++r) {
    const void* theirs = bytes + static_cast<size_t>(r) * kCallRecordBytes;
    std::memcpy(&kind, theirs, sizeof kind);
    if (kind != my_kind)
      fail(DDP_ERR_MISMATCH, "the ranks called different collectives: rank %d %s, rank %d %s", me,
           describe_call(mine).c_str(), r, describe_call(theirs).c_str());
  }
}

void agree_config(Comm& ctrl, const Settings& cfg, Deadline dl) {
  ConfigSummary me;
  std::memset(&me, 0, sizeof me);
  me.fields = agreed_fields(cfg.c);
  me.device_memory = ctrl.memory() == Memory::Device ? 1 : 0;
  if (!me.device_memory) {  // the knobs on the wire size host collectives only
    knobs::WireKnob k[knobs::kNumWireKnobs];
    knobs::wire_knobs(k);
    for (int i = 0; i < knobs::kNumWireKnobs; ++i) me.wire_knobs[i] = k[i].value;
  }
  std::vector<ConfigSummary> all(static_cast<size_t>(ctrl.size()));
  ctrl.allgather_host(&me, all.data(), sizeof me, dl);
  for (size_t r = 1; r < all.size(); ++r) {
    std::string diff = first_difference(all[0].fields, 0, all[r].fields, static_cast<int>(r));
    if (!diff.empty()) fail(DDP_ERR_MISMATCH, "ranks disagree on the config: %s", diff.c_str());
    if (all[r].device_memory != all[0].device_memory)
      fail(DDP_ERR_MISMATCH, "ranks disagree on the memory kind: rank 0 has %s memory but rank %zu has %s memory",
           all[0].device_memory ? "device" : "host", r, all[r].device_memory ? "device" : "host");
  }
  check_wire_knobs(all);
}

JoinTerms join_terms(const Settings& cfg, Memory memory, const std::vector<GradSpec>& specs, bool hook) {
  ConfigSummary c;
  std::memset(&c, 0, sizeof c);
  c.fields = agreed_fields(cfg.c);
  c.device_memory = memory == Memory::Device ? 1 : 0;
  if (!c.device_memory) {
    knobs::WireKnob k[knobs::kNumWireKnobs];
    knobs::wire_knobs(k);
    for (int i = 0; i < knobs::kNumWireKnobs; ++i) c.wire_knobs[i] = k[i].value;
  }
  Digest summary;
  summary.add(&c, sizeof c);
  return JoinTerms{summary.h, registration_hash(specs), static_cast<int64_t>(specs.size()), hook ? 1 : 0};
}

void agree_registration(Comm& ctrl, const std::vector<GradSpec>& specs, bool hook, Deadline dl) {
  RegSummary me;
  std::memset(&me, 0, sizeof me);
  me.kind = kRegistration;
  me.hook = hook ? 1 : 0;
  me.num_grads = static_cast<int64_t>(specs.size());
  me.hash = registration_hash(specs);
  std::vector<RegSummary> all(static_cast<size_t>(ctrl.size()));
  ctrl.allgather_host(&me, all.data(), sizeof me, dl);
  check_same_call_kind(all.data(), ctrl.size(), ctrl.rank());
  bool same = true, same_hook = true;
  for (const RegSummary& s : all) {
    same = same && s.hash == all[0].hash && s.num_grads == all[0].num_grads;
    same_hook = same_hook && s.hook == all[0].hook;
  }
  // Ranks with a hook would hand their buckets to it, the others to the library's allreduce: their
  // collectives need not match. Every rank sees the same summaries, so all fail here together.
  if (same && !same_hook) report_hook_difference(all);
  if (same) return;
  // Every rank compares itself with rank 0's list, then all learn every rank's first difference.
  std::vector<RegEntry> ref(static_cast<size_t>(all[0].num_grads));
  if (ctrl.rank() == 0)
    for (size_t i = 0; i < ref.size(); ++i) ref[i] = entry_of(specs[i]);
  if (!ref.empty()) ctrl.broadcast_host(ref.data(), ref.size() * sizeof(RegEntry), 0, dl);
  const FirstDiff mine = compare_with(ref, specs);
  std::vector<FirstDiff> diffs(all.size());
  ctrl.allgather_host(&mine, diffs.data(), sizeof mine, dl);
  report_difference(ref, diffs);
}

void check_aligned(const void* p, size_t align, const char* dtype, const std::string& what) {
  if (p && reinterpret_cast<uintptr_t>(p) % align != 0)
    fail(DDP_ERR_INVALID_ARGUMENT, "%s at %p is not aligned to its dtype: %s needs %zu-byte alignment", what.c_str(), p,
         dtype, align);
}

void check_grad_aligned(const void* grad, Dtype d, int index) {
  check_aligned(grad, dtype_size(d), dtype_name(d), "grad " + std::to_string(index));
}

void ClaimedMemory::claim(int index, const void* grad, size_t numel, Dtype d) {
  if (!grad) return;
  const uintptr_t lo = reinterpret_cast<uintptr_t>(grad), hi = lo + numel * dtype_size(d);
  // Claims never overlap one another, so only the last one starting before `hi` can overlap this one.
  auto next = by_start_.lower_bound(hi);
  if (next != by_start_.begin()) {
    const auto& [a, c] = *std::prev(next);
    if (c.hi > lo)
      fail(DDP_ERR_INVALID_ARGUMENT,
           "grad %d (%zu bytes at %p) overlaps grad %d (%zu bytes at %p): every grad needs memory of its own "
           "(registered twice, it would be reduced twice)",
           index, static_cast<size_t>(hi - lo), grad, c.index, static_cast<size_t>(c.hi - a),
           reinterpret_cast<const void*>(a));
  }
  by_start_.emplace(lo, Claim{hi, index});
}

void check_sync_agreement(const std::vector<int32_t>& passes) {
  int32_t first = -1;
  bool same = true;
  for (int32_t p : passes) {
    if (p < 0) continue;
    if (first < 0) first = p;
    same = same && p == first;
  }
  if (same) return;
  std::string sides;
  std::vector<char> told(passes.size(), 0);
  for (size_t r = 0; r < passes.size(); ++r) {
    if (passes[r] < 0 || told[r]) continue;
    std::vector<int> ranks;
    for (size_t q = r; q < passes.size(); ++q)
      if (passes[q] == passes[r]) {
        ranks.push_back(static_cast<int>(q));
        told[q] = 1;
      }
    sides += format("%s%s: %d", sides.empty() ? "" : "; ", rank_list(ranks).c_str(), passes[r]);
  }
  fail(DDP_ERR_MISMATCH,
       "ranks disagree on ddp_set_sync: backward passes with sync off before this synced iteration: %s. Every rank "
       "must use the same setting in each iteration (otherwise their reductions pair different iterations)",
       sides.c_str());
}

void IterationReport::times(std::vector<StepTimes>* out) const {
  out->resize(all_.size());
  for (size_t r = 0; r < all_.size(); ++r) (*out)[r] = all_[r].times;
}

int64_t IterationReport::joins() const {
  int64_t most = 0;
  for (const Info& in : all_) most = std::max(most, in.joins);
  return most;
}

std::string IterationReport::exchange(Comm& ctrl, const std::vector<int>& unused, Deadline dl, bool compare_sync,
                                      const StepTimes& mine, int64_t joins) {
  Info me{kIterationEnd,
          static_cast<int32_t>(unused.size()),
          {-1, -1, -1, -1, -1, -1},
          compare_sync ? local_passes_ : -1,
          0,
          mine,
          joins};
  for (size_t i = 0; i < unused.size() && i < 6; ++i) me.first[i] = unused[i];
  all_.resize(static_cast<size_t>(ctrl.size()));
  ctrl.allgather_host(&me, all_.data(), sizeof me, dl);
  check_same_call_kind(all_.data(), ctrl.size(), ctrl.rank());
  passes_.resize(all_.size());
  for (size_t r = 0; r < all_.size(); ++r) passes_[r] = all_[r].local_passes;
  check_sync_agreement(passes_);
  std::string text;
  for (size_t r = 0; r < all_.size(); ++r) {
    const Info& in = all_[r];
    if (in.count == 0) continue;
    text += text.empty() ? "" : "; ";
    text += format("rank %zu: grad%s", r, in.count > 1 ? "s" : "");
    for (int i = 0; i < in.count && i < 6; ++i) text += format("%s %d", i ? "," : "", in.first[i]);
    if (in.count > 6) text += format(" and %d more", in.count - 6);
  }
  return text;
}

}  // namespace ddp
