#include "core/plan.hpp"

namespace ddp {

void Plan::finalize(const std::vector<GradSpec>& specs, int num_streams) {
  bucket_of.assign(specs.size(), -1);
  slot_of.assign(specs.size(), -1);
  for (size_t b = 0; b < buckets.size(); ++b) {
    Bucket& bk = buckets[b];
    if (bk.grads.empty()) fail(DDP_ERR_INTERNAL, "plan: bucket %zu is empty", b);
    bk.dtype = specs[static_cast<size_t>(bk.grads[0])].dtype;
    bk.offsets.resize(bk.grads.size());
    bk.numel = 0;
    bk.stream = static_cast<int>(b % static_cast<size_t>(num_streams));
    for (size_t s = 0; s < bk.grads.size(); ++s) {
      int g = bk.grads[s];
      if (g < 0 || static_cast<size_t>(g) >= specs.size()) fail(DDP_ERR_INTERNAL, "plan: grad %d out of range", g);
      if (bucket_of[static_cast<size_t>(g)] != -1) fail(DDP_ERR_INTERNAL, "plan: grad %d appears twice", g);
      const GradSpec& sp = specs[static_cast<size_t>(g)];
      if (sp.dtype != bk.dtype) fail(DDP_ERR_INTERNAL, "plan: bucket %zu mixes dtypes", b);
      bucket_of[static_cast<size_t>(g)] = static_cast<int>(b);
      slot_of[static_cast<size_t>(g)] = static_cast<int>(s);
      bk.offsets[s] = bk.numel;
      bk.numel += sp.numel;
    }
  }
  for (size_t g = 0; g < specs.size(); ++g)
    if (bucket_of[g] == -1) fail(DDP_ERR_INTERNAL, "plan: grad %zu is in no bucket", g);
}

std::vector<int64_t> Plan::serialize() const {
  std::vector<int64_t> out;
  out.push_back(static_cast<int64_t>(buckets.size()));
  for (const Bucket& b : buckets) out.push_back(static_cast<int64_t>(b.grads.size()));
  for (const Bucket& b : buckets)
    for (int g : b.grads) out.push_back(g);
  return out;
}

Plan Plan::deserialize(const int64_t* data, size_t n, const std::vector<GradSpec>& specs, int num_streams) {
  auto bad = [](const char* why) {
    fail(DDP_ERR_MISMATCH, "the broadcast plan does not fit this rank's grads: %s", why);
  };
  if (n < 1) bad("empty");
  int64_t nb = data[0];
  if (nb < 0 || static_cast<size_t>(nb) > specs.size() || static_cast<size_t>(nb) + 1 > n) bad("bucket count");
  Plan p;
  p.learned = true;
  p.buckets.resize(static_cast<size_t>(nb));
  size_t pos = 1 + static_cast<size_t>(nb);
  for (int64_t b = 0; b < nb; ++b) {
    int64_t sz = data[1 + b];
    if (sz <= 0 || pos + static_cast<size_t>(sz) > n) bad("bucket size");
    for (int64_t k = 0; k < sz; ++k) {
      int64_t g = data[pos++];
      if (g < 0 || static_cast<size_t>(g) >= specs.size()) bad("grad index");
      p.buckets[static_cast<size_t>(b)].grads.push_back(static_cast<int>(g));
    }
  }
  try {
    p.finalize(specs, num_streams);
  } catch (const Error& e) {
    bad(e.what());
  }
  return p;
}

Plan build_plan(const std::vector<GradSpec>& specs, const std::vector<int>& order, size_t message_size,
                int num_streams) {
  bool triggers = false;
  for (const GradSpec& s : specs) triggers |= (s.flags & DDP_GRAD_TRIGGER) != 0;
  Plan p;
  std::vector<int> open[kNumDtypes];
  size_t open_numel[kNumDtypes] = {};
  for (int g : order) {
    const GradSpec& s = specs[static_cast<size_t>(g)];
    int t = static_cast<int>(s.dtype);
    open[t].push_back(g);
    open_numel[t] += s.numel;
    bool close = triggers ? (s.flags & DDP_GRAD_TRIGGER) != 0 : open_numel[t] >= message_size;
    if (close) {
      Bucket b;
      b.grads.swap(open[t]);
      p.buckets.push_back(std::move(b));
      open_numel[t] = 0;
    }
  }
  for (int t = 0; t < kNumDtypes; ++t) {
    if (open[t].empty()) continue;
    Bucket b;
    b.grads.swap(open[t]);
    p.buckets.push_back(std::move(b));
  }
  p.finalize(specs, num_streams);
  return p;
}

Plan registration_plan(const std::vector<GradSpec>& specs, size_t message_size, int num_streams) {
  std::vector<int> order(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) order[i] = static_cast<int>(specs.size() - 1 - i);
  return build_plan(specs, order, message_size, num_streams);
}

void PlanLearner::reset(size_t num_grads) {
  order_.clear();
  order_.reserve(num_grads);
}

Plan PlanLearner::finish(const std::vector<GradSpec>& specs, size_t message_size, int num_streams) const {
  std::vector<char> seen(specs.size(), 0);
  std::vector<int> order;
  order.reserve(specs.size());
  for (int g : order_) {
    if (!seen[static_cast<size_t>(g)]) order.push_back(g);
    seen[static_cast<size_t>(g)] = 1;
  }
  for (size_t i = specs.size(); i-- > 0;)
    if (!seen[i]) order.push_back(static_cast<int>(i));
  Plan p = build_plan(specs, order, message_size, num_streams);
  p.learned = true;
  return p;
}

}  // namespace ddp
