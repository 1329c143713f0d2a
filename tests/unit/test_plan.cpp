// The planner: bucket boundaries per dtype, message_size and triggers, both plan orders, and the
// flat form broadcast by rank 0.
#include <doctest.h>

#include <random>

#include "core/plan.hpp"

using namespace ddp;

static std::vector<GradSpec> specs_of(std::initializer_list<std::pair<size_t, Dtype>> l, unsigned flags = 0) {
  std::vector<GradSpec> v;
  for (auto& p : l) v.push_back(GradSpec{p.first, p.second, flags});
  return v;
}

TEST_CASE("registration plan: reverse order, closed at message_size, one dtype per bucket") {
  auto specs = specs_of({{10, Dtype::F32}, {20, Dtype::F16}, {30, Dtype::F32}, {5, Dtype::F32}, {50, Dtype::F16}});
  Plan p = registration_plan(specs, 35, 2);
  // reverse order: 4(f16,50) 3(f32,5) 2(f32,30) 1(f16,20) 0(f32,10)
  REQUIRE(p.buckets.size() == 4);
  CHECK(p.buckets[0].grads == std::vector<int>{4});     // 50 >= 35 closes at once
  CHECK(p.buckets[1].grads == std::vector<int>{3, 2});  // 5 + 30 = 35 closes
  CHECK(p.buckets[2].grads == std::vector<int>{1});     // f16 leftover first (dtype order)
  CHECK(p.buckets[3].grads == std::vector<int>{0});     // f32 leftover
  CHECK(p.buckets[1].offsets == std::vector<size_t>{0, 5});
  CHECK(p.buckets[1].numel == 35);
  CHECK(p.buckets[0].stream == 0);
  CHECK(p.buckets[1].stream == 1);
  CHECK(p.buckets[2].stream == 0);
  CHECK(p.bucket_of[2] == 1);
  CHECK(p.slot_of[2] == 1);
  CHECK_FALSE(p.learned);
}

TEST_CASE("triggers close buckets and message_size is ignored (apex allreduce_trigger_params)") {
  auto specs = specs_of({{1000, Dtype::F32}, {1000, Dtype::F32}, {1000, Dtype::F32}, {1000, Dtype::F32}});
  specs[2].flags = DDP_GRAD_TRIGGER;
  Plan p = registration_plan(specs, 1, 1);
  REQUIRE(p.buckets.size() == 2);
  CHECK(p.buckets[0].grads == std::vector<int>{3, 2});
  CHECK(p.buckets[1].grads == std::vector<int>{1, 0});
}

TEST_CASE("learned plan follows arrival order; unseen grads follow in reverse registration order") {
  auto specs = specs_of({{4, Dtype::F32}, {4, Dtype::F32}, {4, Dtype::F32}, {4, Dtype::F64}});
  PlanLearner l;
  l.reset(specs.size());
  l.record(1);
  l.record(3);
  l.record(0);
  Plan p = l.finish(specs, 8, 1);
  CHECK(p.learned);
  REQUIRE(p.buckets.size() == 3);
  CHECK(p.buckets[0].grads == std::vector<int>{1, 0});
  CHECK(p.buckets[1].grads == std::vector<int>{2});  // f32 leftover (unseen grad 2)
  CHECK(p.buckets[2].grads == std::vector<int>{3});  // f64 leftover
}

TEST_CASE("serialize and deserialize round-trip on random plans; bad input is a mismatch") {
  std::mt19937 rng(1);
  for (int t = 0; t < 200; ++t) {
    std::vector<GradSpec> specs;
    int n = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) specs.push_back(GradSpec{1 + rng() % 100, static_cast<Dtype>(rng() % 4), 0});
    Plan p = registration_plan(specs, 1 + rng() % 300, 1 + static_cast<int>(rng() % 4));
    std::vector<int64_t> w = p.serialize();
    REQUIRE(w.size() <= 1 + 2 * specs.size());
    Plan q = Plan::deserialize(w.data(), w.size(), specs, 3);
    REQUIRE(q.buckets.size() == p.buckets.size());
    for (size_t b = 0; b < p.buckets.size(); ++b) {
      CHECK(q.buckets[b].grads == p.buckets[b].grads);
      CHECK(q.buckets[b].numel == p.buckets[b].numel);
      CHECK(q.buckets[b].stream == static_cast<int>(b % 3));
    }
  }
  auto specs = specs_of({{4, Dtype::F32}, {4, Dtype::F16}});
  std::vector<int64_t> dup = {1, 2, 0, 0};
  CHECK_THROWS_AS(Plan::deserialize(dup.data(), dup.size(), specs, 1), Error);
  std::vector<int64_t> mixed = {1, 2, 0, 1};  // mixes dtypes
  CHECK_THROWS_AS(Plan::deserialize(mixed.data(), mixed.size(), specs, 1), Error);
  std::vector<int64_t> missing = {1, 1, 0};
  CHECK_THROWS_AS(Plan::deserialize(missing.data(), missing.size(), specs, 1), Error);
  try {
    Plan::deserialize(missing.data(), missing.size(), specs, 1);
  } catch (const Error& e) {
    CHECK(e.status() == DDP_ERR_MISMATCH);
  }
}
