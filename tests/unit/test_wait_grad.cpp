// ddp_wait_grad: a grad's reduced value before ddp_finish_backward, its bucket alone waited for. Values
// against the float64 reference at 1..4 ranks and random configs, the waits that must not wait for
// later buckets, the answers "not yet" (nothing launched), the refusals, and a bucket's error.
#include <doctest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../support/random_grads.hpp"
#include "ddp.h"
#include "local_ranks.hpp"

namespace {

// Random grads in random dtypes, marked in a different order on every rank; after each mark, a wait
// on a random grad marked so far. Every grad answered "reduced" must hold its reduced value at once
// (checked before ddp_finish_backward), and every grad after it. Returns false on any difference;
// *answered counts the grads answered reduced.
bool wait_random(int rank, int world, ddp_comm_t comm, uint64_t seed, const ddp_config_t& cfg, int* answered) {
  std::mt19937_64 shared(seed), mine(seed + 1 + static_cast<uint64_t>(rank));
  ddp_t d;
  if (ddp_create(comm, &cfg, &d) != DDP_SUCCESS) return false;
  ref::RandomGrads g;
  bool ok = g.make(d, seed, cfg, shared, 20);
  const double scale = cfg.gradient_average ? 1.0 / world : 1.0 / cfg.gradient_predivide_factor;
  // Every grad marked: with nothing held back, every bucket is launched and every wait answers 1.
  const bool all_launch = !cfg.delay_allreduce && cfg.plan_order == DDP_PLAN_REGISTRATION;
  std::vector<int> order(g.idx);
  for (int it = 0; it < 3 && ok; ++it) {
    g.fill(rank, it);
    std::shuffle(order.begin(), order.end(), mine);
    ok = ddp_begin_backward(d, nullptr) == DDP_SUCCESS;
    for (size_t k = 0; ok && k < order.size(); ++k) {
      ok = ddp_grad_ready(d, order[k]) == DDP_SUCCESS;
      const int w = order[static_cast<size_t>(mine() % (k + 1))];
      int reduced = -1;
      ok = ok && ddp_wait_grad(d, w, nullptr, &reduced) == DDP_SUCCESS && (reduced == 0 || reduced == 1);
      if (ok && reduced) ok = g.reduced(w, it, world, scale), ++*answered;
    }
    for (int i = 0; ok && i < g.count(); ++i) {
      int reduced = -1;
      ok = ddp_wait_grad(d, i, nullptr, &reduced) == DDP_SUCCESS && (reduced == 1 || !all_launch);
      if (ok && reduced) ok = g.reduced(i, it, world, scale), ++*answered;
    }
    ok = ok && ddp_finish_backward(d, nullptr) == DDP_SUCCESS;
    for (int i = 0; ok && i < g.count(); ++i) ok = g.reduced(i, it, world, scale);
  }
  ddp_destroy(d);
  return ok;
}

// Four grads of 1000 floats, one bucket each (registration plan: grad 3's bucket first); a hook
// that sums, and sleeps `slow_ms` in bucket `slow` first.
struct Slow {
  int slow = -1, slow_ms = 0;
  std::atomic<int> finished{0};  // buckets whose hook returned
};

ddp_status_t slow_hook(const ddp_hook_bucket_t* b, void* user) {
  Slow& s = *static_cast<Slow*>(user);
  if (b->bucket == s.slow) std::this_thread::sleep_for(std::chrono::milliseconds(s.slow_ms));
  const ddp_status_t st = ddp_comm_allreduce(b->comm, b->buffer, b->count, b->dtype, DDP_OP_SUM, b->stream);
  ++s.finished;
  return st;
}

ddp_status_t failing_hook(const ddp_hook_bucket_t* b, void*) {
  if (b->bucket == 1) return DDP_ERR_INVALID_ARGUMENT;
  return ddp_comm_allreduce(b->comm, b->buffer, b->count, b->dtype, DDP_OP_SUM, b->stream);
}

struct Four {
  ddp_t d = nullptr;
  std::vector<std::vector<float>> g = std::vector<std::vector<float>>(4, std::vector<float>(1000));
  int idx[4] = {0, 0, 0, 0};
  bool make(ddp_comm_t c, ddp_config_t cfg) {
    cfg.message_size = 1000;
    if (ddp_create(c, &cfg, &d) != DDP_SUCCESS) return false;
    for (int i = 0; i < 4; ++i)
      if (ddp_register_grad(d, g[static_cast<size_t>(i)].data(), 1000, DDP_F32, 0, &idx[i]) != DDP_SUCCESS)
        return false;
    return true;
  }
  void fill(int rank) {
    for (int i = 0; i < 4; ++i)
      for (size_t e = 0; e < 1000; ++e) g[static_cast<size_t>(i)][e] = static_cast<float>(rank + 1 + i);
  }
  ~Four() {
    if (d) ddp_destroy(d);
  }
};

ddp_config_t registration_plan() {
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.plan_order = DDP_PLAN_REGISTRATION;
  cfg.gradient_average = 0;
  cfg.timeout_ms = 30000;
  return cfg;
}

bool said(ddp_status_t got, ddp_status_t want, const char* text) {
  if (got == want && std::strstr(ddp_last_error(), text)) return true;
  std::fprintf(stderr, "got %s: %s (wanted %s, \"%s\")\n", ddp_status_string(got), ddp_last_error(),
               ddp_status_string(want), text);
  return false;
}

}  // namespace

TEST_CASE("ddp_wait_grad: every grad answered reduced holds its reduced value, 1..4 ranks, random configs") {
  std::mt19937_64 rng(4711);
  int answered_all = 0;
  for (int world = 1; world <= 4; ++world)
    for (int t = 0; t < 6; ++t) {
      ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
      cfg.message_size = 1 + rng() % 5000;
      cfg.layout = static_cast<int>(rng() % 2);
      cfg.plan_order = t < 4 ? DDP_PLAN_REGISTRATION : static_cast<int>(rng() % 2);
      cfg.num_streams = 1 + static_cast<int>(rng() % 3);
      cfg.gradient_average = static_cast<int>(rng() % 2);
      cfg.gradient_predivide_factor = rng() % 2 ? 1.0 : 4.0;
      cfg.allreduce_always_fp32 = static_cast<int>(rng() % 2);
      cfg.delay_allreduce = t == 5 ? static_cast<int>(rng() % 2) : 0;
      cfg.timeout_ms = 30000;
      const uint64_t seed = rng();
      std::atomic<int> answered{0};
      const int failed = on_ranks(world, [&](int r, ddp_comm_t c) {
        int a = 0;
        const bool ok = wait_random(r, world, c, seed, cfg, &a);
        answered += a;
        return ok;
      });
      answered_all += answered.load();
      CHECK_MESSAGE(failed == 0, "world ", world, " layout ", cfg.layout, " plan ", cfg.plan_order, " streams ",
                    cfg.num_streams, " delay ", cfg.delay_allreduce);
    }
  CHECK(answered_all > 0);
}

TEST_CASE("ddp_wait_grad: waits for its own bucket only, while a later one is still on the wire") {
  for (int world : {2, 3}) {
    const int failed = on_ranks(world, [&](int rank, ddp_comm_t c) {
      Slow slow;
      slow.slow = 1;  // grad 2's bucket: launched after grad 3's, still in its hook when grad 3 is waited for
      slow.slow_ms = 300;
      Four f;
      if (!f.make(c, registration_plan())) return false;
      bool ok = ddp_set_comm_hook(f.d, slow_hook, &slow) == DDP_SUCCESS;
      f.fill(rank);
      ok = ok && ddp_begin_backward(f.d, nullptr) == DDP_SUCCESS;
      for (int i = 3; ok && i >= 0; --i) ok = ddp_grad_ready(f.d, f.idx[i]) == DDP_SUCCESS;
      const auto t0 = std::chrono::steady_clock::now();
      int reduced = 0;
      ok = ok && ddp_wait_grad(f.d, f.idx[3], nullptr, &reduced) == DDP_SUCCESS && reduced == 1;
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      // Grad 3 is reduced, and the wait did not wait for bucket 1's 300 ms (mutation: draining the whole
      // stream waits for it).
      const float want = static_cast<float>(world * (world + 1) / 2 + 3 * world);
      ok = ok && f.g[3][0] == want && f.g[3][999] == want;
      if (ok && (slow.finished.load() >= 2 || ms > 200)) {
        MESSAGE("rank ", rank, ": waited ", ms, " ms, ", slow.finished.load(), " buckets finished");
        ok = false;
      }
      // Grad 2 waits for its bucket: its value is final when the wait returns.
      ok = ok && ddp_wait_grad(f.d, f.idx[2], nullptr, &reduced) == DDP_SUCCESS && reduced == 1;
      const float want2 = static_cast<float>(world * (world + 1) / 2 + 2 * world);
      ok = ok && f.g[2][0] == want2 && f.g[2][999] == want2;
      ok = ok && ddp_finish_backward(f.d, nullptr) == DDP_SUCCESS;
      ddp_stats_t s;
      s.size = sizeof s;
      ok = ok && ddp_get_stats(f.d, &s) == DDP_SUCCESS && s.last_exposed_ns >= 250000000ull;
      return ok;
    });
    CHECK_MESSAGE(failed == 0, "world ", world);
  }
}

TEST_CASE("ddp_wait_grad: answers 0 where nothing is launched yet, and never waits then") {
  const int failed = on_ranks(2, [](int rank, ddp_comm_t c) {
    bool ok = true;
    int reduced = -1;
    {  // The bucket waits for a grad not marked yet (grad 3's bucket comes first in the plan).
      Four f;
      ok = f.make(c, registration_plan());
      f.fill(rank);
      ok = ok && ddp_begin_backward(f.d, nullptr) == DDP_SUCCESS;
      ok = ok && ddp_grad_ready(f.d, f.idx[2]) == DDP_SUCCESS;
      ok = ok && ddp_wait_grad(f.d, f.idx[2], nullptr, &reduced) == DDP_SUCCESS && reduced == 0;
      for (int i : {3, 1, 0}) ok = ok && ddp_grad_ready(f.d, f.idx[i]) == DDP_SUCCESS;
      ok = ok && ddp_wait_grad(f.d, f.idx[2], nullptr, &reduced) == DDP_SUCCESS && reduced == 1;
      ok = ok && ddp_finish_backward(f.d, nullptr) == DDP_SUCCESS;
      // Sync off: only accumulated.
      ok = ok && ddp_set_sync(f.d, 0) == DDP_SUCCESS && ddp_begin_backward(f.d, nullptr) == DDP_SUCCESS;
      for (int i : {3, 2, 1, 0}) ok = ok && ddp_grad_ready(f.d, f.idx[i]) == DDP_SUCCESS;
      ok = ok && ddp_wait_grad(f.d, f.idx[3], nullptr, &reduced) == DDP_SUCCESS && reduced == 0;
      ok = ok && ddp_finish_backward(f.d, nullptr) == DDP_SUCCESS;
    }
    {  // delay_allreduce: everything at ddp_finish_backward.
      ddp_config_t cfg = registration_plan();
      cfg.delay_allreduce = 1;
      Four f;
      ok = ok && f.make(c, cfg) && ddp_begin_backward(f.d, nullptr) == DDP_SUCCESS;
      for (int i : {3, 2, 1, 0}) ok = ok && ddp_grad_ready(f.d, f.idx[i]) == DDP_SUCCESS;
      ok = ok && ddp_wait_grad(f.d, f.idx[3], nullptr, &reduced) == DDP_SUCCESS && reduced == 0;
      ok = ok && ddp_finish_backward(f.d, nullptr) == DDP_SUCCESS;
    }
    {  // A learned plan: nothing launches in the first iteration; the second waits.
      ddp_config_t cfg = registration_plan();
      cfg.plan_order = DDP_PLAN_LEARNED;
      Four f;
      ok = ok && f.make(c, cfg);
      for (int it = 0; ok && it < 2; ++it) {
        ok = ddp_begin_backward(f.d, nullptr) == DDP_SUCCESS;
        for (int i : {3, 2, 1, 0}) ok = ok && ddp_grad_ready(f.d, f.idx[i]) == DDP_SUCCESS;
        ok = ok && ddp_wait_grad(f.d, f.idx[3], nullptr, &reduced) == DDP_SUCCESS && reduced == it;
        ok = ok && ddp_finish_backward(f.d, nullptr) == DDP_SUCCESS;
      }
    }
    return ok;
  });
  CHECK(failed == 0);
}

TEST_CASE("ddp_wait_grad: wrong calls are refused by name, and a bucket's error surfaces in it") {
  const int failed = on_ranks(2, [](int rank, ddp_comm_t c) {
    bool ok = true;
    int reduced = -1;
    {
      Four f;
      ok = f.make(c, registration_plan());
      ok = ok &&
           said(ddp_wait_grad(f.d, f.idx[0], nullptr, &reduced), DDP_ERR_INVALID_STATE, "no backward pass in progress");
      ok = ok && ddp_begin_backward(f.d, nullptr) == DDP_SUCCESS;
      ok = ok && said(ddp_wait_grad(f.d, f.idx[3], nullptr, &reduced), DDP_ERR_INVALID_STATE,
                      "grad 3 was not marked ready in this backward pass");
      ok = ok && said(ddp_wait_grad(f.d, 4, nullptr, &reduced), DDP_ERR_INVALID_ARGUMENT, "4");
      ok = ok && said(ddp_wait_grad(f.d, -1, nullptr, &reduced), DDP_ERR_INVALID_ARGUMENT, "-1");
      ok = ok && ddp_grad_ready(f.d, f.idx[3]) == DDP_SUCCESS;
      ok = ok && said(ddp_wait_grad(f.d, f.idx[3], nullptr, nullptr), DDP_ERR_INVALID_ARGUMENT, "reduced");
      for (int i : {2, 1, 0}) ok = ok && ddp_grad_ready(f.d, f.idx[i]) == DDP_SUCCESS;
      ok = ok && ddp_finish_backward(f.d, nullptr) == DDP_SUCCESS;  // the refusals left the context intact
      ok = ok && said(ddp_wait_grad(f.d, f.idx[0], nullptr, &reduced), DDP_ERR_INVALID_STATE,
                      "after ddp_finish_backward every grad is reduced");
    }
    {  // A hook that fails bucket 1 (grad 2): a wait reports it; the context aborts.
      Four f;
      ok = ok && f.make(c, registration_plan());
      ok = ok && ddp_set_comm_hook(f.d, failing_hook, nullptr) == DDP_SUCCESS;
      f.fill(rank);
      ok = ok && ddp_begin_backward(f.d, nullptr) == DDP_SUCCESS;
      for (int i : {3, 2, 1, 0}) ok = ok && ddp_grad_ready(f.d, f.idx[i]) == DDP_SUCCESS;
      // (Bucket 0 is fine, but bucket 1 may have failed before it is waited for: the first error of
      // the stream surfaces at the first wait.)
      const ddp_status_t first = ddp_wait_grad(f.d, f.idx[3], nullptr, &reduced);
      if (first == DDP_SUCCESS)
        ok = ok && reduced == 1 &&
             said(ddp_wait_grad(f.d, f.idx[2], nullptr, &reduced), DDP_ERR_ABORTED, "comm hook returned");
      else
        ok = ok && said(first, DDP_ERR_ABORTED, "comm hook returned 1 (invalid argument) for bucket 1");
      ok = ok && said(ddp_finish_backward(f.d, nullptr), DDP_ERR_ABORTED, "comm hook returned");
    }
    return ok;
  });
  CHECK(failed == 0);
}
