// Deadlines from durations as large as the API accepts (INT64_MAX ms): the clock arithmetic saturates
// (a point past the clock's range is "never") instead of overflowing into the past, which made every
// wait time out at once. Run under UBSan too: an overflow there is a report.
#include <doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "core/common.hpp"
#include "ddp.h"
#include "local_ranks.hpp"

using namespace ddp;

namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
// The first timeout whose nanoseconds overflow int64_t: where the arithmetic used to break.
constexpr int64_t kOverflowMs = int64_t(9300000000000);
// The largest timeout_ms and stall_warning_ms the config accepts (config_fields.def).
constexpr int64_t kConfigMaxMs = int64_t(9200000000000000000);

std::atomic<int> g_warnings{0};
void count_log(ddp_log_level_t level, const char*, void*) {
  if (level == DDP_LOG_WARN) ++g_warnings;
}

// Two iterations of 3 grads on a rank of a local group; false on any failed call.
bool train(ddp_comm_t c, int64_t timeout_ms, int64_t stall_ms) {
  ddp_config_t cfg;
  ddp_config_init(&cfg);
  cfg.timeout_ms = timeout_ms;
  cfg.stall_warning_ms = stall_ms;
  cfg.message_size = 64;
  ddp_t d = nullptr;
  if (ddp_create(c, &cfg, &d) != DDP_SUCCESS) return false;
  std::vector<std::vector<float>> g(3, std::vector<float>(100, 1.0f));
  bool ok = true;
  int index = -1;
  for (auto& v : g) ok = ok && ddp_register_grad(d, v.data(), v.size(), DDP_F32, 0, &index) == DDP_SUCCESS;
  ok = ok && ddp_commit(d) == DDP_SUCCESS;
  for (int it = 0; ok && it < 2; ++it) {
    ok = ddp_begin_backward(d, nullptr) == DDP_SUCCESS;
    for (int i = 2; i >= 0; --i) ok = ok && ddp_grad_ready(d, i) == DDP_SUCCESS;
    ok = ok && ddp_finish_backward(d, nullptr) == DDP_SUCCESS;
  }
  ok = ok && ddp_synchronize(d) == DDP_SUCCESS;
  ddp_destroy(d);
  return ok;
}

}  // namespace

TEST_CASE("deadline: durations past the clock's range saturate to never") {
  using Clock = Deadline::Clock;
  const Clock::time_point now = Clock::now();
  CHECK(add_ms_saturated(now, kMax) == Clock::time_point::max());
  CHECK(add_ms_saturated(now, kOverflowMs) == Clock::time_point::max());
  CHECK(add_ms_saturated(now, 0) == now);
  CHECK(add_ms_saturated(now, -5) == now);
  CHECK(add_ms_saturated(now, 1000) == now + std::chrono::seconds(1));
  CHECK(add_ms_saturated(Clock::time_point::max(), 1) == Clock::time_point::max());
  // A large but representable duration still is a point in the future, not the end.
  const int64_t year_ms = int64_t(365) * 24 * 3600 * 1000;
  CHECK(add_ms_saturated(now, year_ms) > now);
  CHECK(add_ms_saturated(now, year_ms) < Clock::time_point::max());

  for (int64_t ms : {kOverflowMs, kMax, kMax / 2, kConfigMaxMs}) {
    const Deadline d = Deadline::after_ms(ms);
    CHECK_MESSAGE(d.infinite(), ms);
    CHECK_MESSAGE(!d.passed(), ms);
  }
  const Deadline year = Deadline::after_ms(year_ms);
  CHECK(!year.infinite());
  CHECK(!year.passed());
  CHECK(Deadline::never().infinite());
  CHECK(Deadline::after_ms(0).infinite());

  const Deadline soon = Deadline::after_ms(1);
  CHECK(Deadline::earlier(soon, year).at() == soon.at());
  CHECK(Deadline::earlier(Deadline::never(), soon).at() == soon.at());
  CHECK(Deadline::earlier(year, Deadline::never()).at() == year.at());
  CHECK(Deadline::earlier(Deadline::never(), Deadline::never()).infinite());
  std::this_thread::sleep_for(std::chrono::milliseconds(3));
  CHECK(soon.passed());
}

// Through the API on a local group: a timeout or stall warning of ~9.3e12 ms or more used to time
// every collective out at once and warn at once.
TEST_CASE("deadline: huge timeout_ms and stall_warning_ms train normally, with no warning") {
  REQUIRE(ddp_set_log_callback(count_log, nullptr) == DDP_SUCCESS);
  for (int64_t ms : {kOverflowMs, kConfigMaxMs}) {
    g_warnings = 0;
    CHECK_MESSAGE(on_ranks(2, [&](int, ddp_comm_t c) { return train(c, ms, ms); }) == 0, ms);
    CHECK_MESSAGE(on_ranks(2, [&](int, ddp_comm_t c) { return train(c, ms, 0); }) == 0, ms);
    CHECK_MESSAGE(on_ranks(2, [&](int, ddp_comm_t c) { return train(c, 0, ms); }) == 0, ms);
    CHECK_MESSAGE(g_warnings.load() == 0, ms);
  }
  ddp_set_log_callback(nullptr, nullptr);
}
