// Comm hooks over in-process ranks (a local group): a hook that calls back into its own context is
// refused at once (never a deadlock), a hook that never returns ends in DDP_ERR_TIMEOUT at timeout_ms,
// a hook's result is the gradient (the library scales nothing), and its traffic is counted.
#include <doctest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "ddp.h"
#include "local_ranks.hpp"

namespace {

struct Reentry {
  bool reenter = false;  // the hook calls back into its own context
  ddp_t ctx = nullptr;
  ddp_op_t op = DDP_OP_SUM;  // the sum (DDP_OP_AVG would average: the local comm sums, then scales)
  int calls = 0;
  int refused = 0;      // ddp_get_stats and ddp_destroy on the hook's own context, refused as they should
  std::string message;  // the first refusal's
  int sleep_ms = 0;     // a stuck hook: sleeps this long before it reduces
  int stuck_rank = -1;  // ... on this rank only
};

ddp_status_t reentering_hook(const ddp_hook_bucket_t* b, void* user) {
  Reentry* r = static_cast<Reentry*>(user);
  ++r->calls;
  if (r->reenter) {
    ddp_stats_t st;
    st.size = sizeof st;
    const ddp_status_t s1 = ddp_get_stats(r->ctx, &st);
    if (s1 == DDP_ERR_INVALID_STATE && r->message.empty()) r->message = ddp_last_error();
    const ddp_status_t s2 = ddp_destroy(r->ctx);
    if (s1 == DDP_ERR_INVALID_STATE && s2 == DDP_ERR_INVALID_STATE &&
        std::strstr(ddp_last_error(), "called from inside this context's comm hook (bucket 0)"))
      ++r->refused;
  }
  if (b->rank == r->stuck_rank) {  // written off meanwhile: it touches nothing of the library after
    std::this_thread::sleep_for(std::chrono::milliseconds(r->sleep_ms));
    return DDP_SUCCESS;
  }
  return ddp_comm_allreduce(b->comm, b->buffer, b->count, b->dtype, r->op, b->stream);
}

// One grad of `n` floats holding rank + 1, one iteration (or `iterations`) through the hook.
struct Run {
  ddp_status_t finish = DDP_SUCCESS;
  std::string error;
  std::vector<float> grad;
  ddp_stats_t stats{};
  double finish_ms = 0;
};

Run run_hooked(int rank, ddp_comm_t comm, Reentry* r, ddp_config_t cfg, size_t n, int iterations) {
  Run out;
  out.grad.assign(n, 0.0f);
  ddp_t d = nullptr;
  REQUIRE(ddp_create(comm, &cfg, &d) == DDP_SUCCESS);
  r->ctx = d;
  REQUIRE(ddp_set_comm_hook(d, reentering_hook, r) == DDP_SUCCESS);
  int idx = 0;
  REQUIRE(ddp_register_grad(d, out.grad.data(), n, DDP_F32, 0, &idx) == DDP_SUCCESS);
  for (int it = 0; it < iterations && out.finish == DDP_SUCCESS; ++it) {
    for (float& x : out.grad) x = static_cast<float>(rank + 1);
    REQUIRE(ddp_begin_backward(d, nullptr) == DDP_SUCCESS);
    REQUIRE(ddp_grad_ready(d, idx) == DDP_SUCCESS);
    const auto t0 = std::chrono::steady_clock::now();
    out.finish = ddp_finish_backward(d, nullptr);
    out.finish_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (out.finish != DDP_SUCCESS) out.error = ddp_last_error();
  }
  out.stats.size = sizeof out.stats;
  REQUIRE(ddp_get_stats(d, &out.stats) == DDP_SUCCESS);
  ddp_destroy(d);
  return out;
}

ddp_config_t hook_config(int64_t timeout_ms) {
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.plan_order = DDP_PLAN_REGISTRATION;
  cfg.unused_policy = DDP_UNUSED_ZERO;
  cfg.timeout_ms = timeout_ms;
  return cfg;
}

}  // namespace

TEST_CASE("comm hook: a call back into its own context is refused with a message, and the run succeeds") {
  const int world = 2;
  const int failed = on_ranks(world, [&](int rank, ddp_comm_t comm) {
    Reentry r;
    r.reenter = true;
    const Run out = run_hooked(rank, comm, &r, hook_config(10000), 100, 2);
    CHECK_MESSAGE(out.finish == DDP_SUCCESS, out.error);
    CHECK(r.calls == 2);
    CHECK(r.refused == 2);
    CHECK(r.message.find("ddp_get_stats: called from inside this context's comm hook (bucket 0): a hook may call "
                         "only ddp_comm_allreduce on bucket->comm") == 0);
    CHECK(out.grad[0] == 3.0f);
    return out.finish == DDP_SUCCESS && r.refused == 2;
  });
  CHECK(failed == 0);
}

TEST_CASE("comm hook: a hook stuck past timeout_ms ends in DDP_ERR_TIMEOUT at the timeout") {
  const int failed = on_ranks(2, [&](int rank, ddp_comm_t comm) {
    Reentry r;
    r.stuck_rank = 0;
    r.sleep_ms = 3000;  // user code that does not return in time
    const Run out = run_hooked(rank, comm, &r, hook_config(300), 100, 1);
    // The stuck rank times out; its peer, waiting in its own hook's allreduce, either times out too or
    // hears first that rank 0 gave up (whichever comes first: both are the truth).
    const bool peer_told =
        rank != 0 && out.finish == DDP_ERR_ABORTED && out.error.find("aborted by rank 0") != std::string::npos;
    CHECK_MESSAGE((out.finish == DDP_ERR_TIMEOUT || peer_told), out.error);
    CHECK(out.finish_ms < 2000);
    return (out.finish == DDP_ERR_TIMEOUT || peer_told) && out.finish_ms < 2000;
  });
  CHECK(failed == 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(3000));  // the written-off hook returns and parks
}

TEST_CASE("comm hook: the hook's result is the gradient; the library applies neither predivide nor averaging") {
  for (int avg = 0; avg < 2; ++avg) {
    const int world = 2;
    const int failed = on_ranks(world, [&](int rank, ddp_comm_t comm) {
      Reentry r;
      ddp_config_t cfg = hook_config(10000);
      cfg.gradient_average = avg;
      cfg.gradient_predivide_factor = 4.0;
      const Run out = run_hooked(rank, comm, &r, cfg, 64, 1);
      const float want = 3.0f;  // ranks hold 1 and 2: the hook's sum, unscaled
      CHECK_MESSAGE(out.grad[0] == want, "gradient_average ", avg, ": got ", out.grad[0]);
      return out.finish == DDP_SUCCESS && out.grad[0] == want;
    });
    CHECK(failed == 0);
  }
}

TEST_CASE("stats: traffic grows with world size, payload does not; the local comm counts the ring's bytes") {
  const size_t n = 12 * 1024;  // divisible by 1..4 ranks
  for (int world = 1; world <= 4; ++world) {
    const int failed = on_ranks(world, [&](int rank, ddp_comm_t comm) {
      Reentry r;
      const Run out = run_hooked(rank, comm, &r, hook_config(10000), n, 1);
      // The hook's one allreduce: 2 (w - 1) / w of the bucket each way; control exchanges come on top.
      const uint64_t ring = 2 * uint64_t(world - 1) * n * 4 / uint64_t(world);
      CHECK(out.stats.bytes_reduced == n * 4);
      CHECK(out.stats.bytes_sent >= ring);
      CHECK(out.stats.bytes_sent < ring + 4096);
      CHECK(out.stats.bytes_received >= ring);
      CHECK(out.stats.bytes_received < ring + 4096);
      if (world == 1) CHECK(out.stats.bytes_sent == 0);
      return out.finish == DDP_SUCCESS;
    });
    CHECK(failed == 0);
  }
}
