// The reducer's state machine across in-process ranks (a local group: one thread per rank): random
// grads and a different arrival order per rank, launches during backward, and no allocation in the
// steady-state hook or iteration.
#include <doctest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../support/random_grads.hpp"
#include "ddp.h"
#include "local_ranks.hpp"

#include <fcntl.h>
#include <unistd.h>

// Counts operator new calls made by the current thread.
static thread_local long t_allocs = 0;
void* operator new(size_t n) {
  ++t_allocs;
  void* p = std::malloc(n ? n : 1);
  if (!p) throw std::bad_alloc();
  return p;
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace {

bool reduce_random(int rank, int world, ddp_comm_t comm, uint64_t seed, const ddp_config_t& cfg) {
  std::mt19937_64 shared(seed), mine(seed + 1 + static_cast<uint64_t>(rank));
  ddp_t d;
  if (ddp_create(comm, &cfg, &d) != DDP_SUCCESS) return false;
  ref::RandomGrads g;
  bool ok = g.make(d, seed, cfg, shared, 30);
  std::vector<int> order(g.idx);
  const double scale = cfg.gradient_average ? 1.0 / world : 1.0 / cfg.gradient_predivide_factor;
  for (int it = 0; it < 3 && ok; ++it) {
    g.fill(rank, it);
    std::shuffle(order.begin(), order.end(), mine);
    ok = ddp_begin_backward(d, nullptr) == DDP_SUCCESS;
    for (int i : order) ok = ok && ddp_grad_ready(d, i) == DDP_SUCCESS;
    ok = ok && ddp_finish_backward(d, nullptr) == DDP_SUCCESS;
    for (int i = 0; ok && i < g.count(); ++i) ok = g.reduced(i, it, world, scale);
  }
  ddp_destroy(d);
  return ok;
}

}  // namespace

TEST_CASE("local group: random grads and orders reduce to the reference at 1..4 ranks") {
  std::mt19937_64 rng(42);
  for (int world = 1; world <= 4; ++world)
    for (int t = 0; t < 6; ++t) {
      ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
      cfg.message_size = 1 + rng() % 5000;
      cfg.layout = static_cast<int>(rng() % 2);
      cfg.plan_order = static_cast<int>(rng() % 2);
      cfg.num_streams = 1 + static_cast<int>(rng() % 3);
      cfg.gradient_average = static_cast<int>(rng() % 2);
      cfg.gradient_predivide_factor = rng() % 2 ? 1.0 : 4.0;
      cfg.allreduce_always_fp32 = static_cast<int>(rng() % 2);
      cfg.delay_allreduce = static_cast<int>(rng() % 2);
      cfg.timeout_ms = 30000;
      uint64_t seed = rng();
      int failed = on_ranks(world, [&](int r, ddp_comm_t c) { return reduce_random(r, world, c, seed, cfg); });
      CHECK_MESSAGE(failed == 0, "world ", world, " layout ", cfg.layout, " plan ", cfg.plan_order, " streams ",
                    cfg.num_streams);
    }
}

TEST_CASE("buckets launch during backward, in plan order, before finish") {
  int failed = on_ranks(2, [](int, ddp_comm_t c) {
    ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
    cfg.plan_order = DDP_PLAN_REGISTRATION;
    cfg.message_size = 100;
    ddp_t d;
    if (ddp_create(c, &cfg, &d) != DDP_SUCCESS) return false;
    std::vector<std::vector<float>> g(4, std::vector<float>(100, 1.0f));
    int idx[4];
    for (int i = 0; i < 4; ++i) ddp_register_grad(d, g[static_cast<size_t>(i)].data(), 100, DDP_F32, 0, &idx[i]);
    // Registration plan: buckets {3}, {2}, {1}, {0}. Grad 2 first: nothing may launch (bucket 0 waits).
    bool ok = ddp_begin_backward(d, nullptr) == DDP_SUCCESS;
    ok = ok && ddp_grad_ready(d, idx[2]) == DDP_SUCCESS;
    ddp_stats_t s;
    s.size = sizeof s;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ddp_get_stats(d, &s);
    ok = ok && s.buckets_reduced == 0;
    ok = ok && ddp_grad_ready(d, idx[3]) == DDP_SUCCESS;  // launches buckets 0 and 1
    for (int w = 0; w < 2000 && s.buckets_reduced < 2; ++w) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ddp_get_stats(d, &s);
    }
    ok = ok && s.buckets_reduced == 2;  // reduced while backward is still going
    ok = ok && ddp_grad_ready(d, idx[0]) == DDP_SUCCESS;
    ok = ok && ddp_grad_ready(d, idx[1]) == DDP_SUCCESS;
    ok = ok && ddp_finish_backward(d, nullptr) == DDP_SUCCESS;
    ddp_get_stats(d, &s);
    ok = ok && s.buckets_reduced == 4 && s.bytes_reduced == 1600;
    ddp_destroy(d);
    return ok;
  });
  CHECK(failed == 0);
}

TEST_CASE("steady state: the hook and the whole iteration allocate nothing") {
  for (int policy : {DDP_UNUSED_ERROR, DDP_UNUSED_ZERO})
    for (int layout : {DDP_LAYOUT_COPY, DDP_LAYOUT_ARENA}) {
      std::atomic<long> hook_allocs{0}, iter_allocs{0};
      int failed = on_ranks(2, [&](int, ddp_comm_t c) {
        ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
        cfg.message_size = 300;
        cfg.num_streams = 2;
        cfg.layout = layout;
        cfg.unused_policy = policy;
        ddp_t d;
        if (ddp_create(c, &cfg, &d) != DDP_SUCCESS) return false;
        std::vector<std::vector<float>> g(20, std::vector<float>(100, 1.0f));
        int idx[20];
        for (int i = 0; i < 20; ++i)
          ddp_register_grad(d, layout ? nullptr : g[static_cast<size_t>(i)].data(), 100, DDP_F32, 0, &idx[i]);
        bool ok = true;
        for (int it = 0; it < 5 && ok; ++it) {
          long before_iter = t_allocs;
          ok = ddp_begin_backward(d, nullptr) == DDP_SUCCESS;
          long before_hook = t_allocs;
          for (int i = 19; i >= 0; --i) ok = ok && ddp_grad_ready(d, idx[i]) == DDP_SUCCESS;
          long hook = t_allocs - before_hook;
          ok = ok && ddp_finish_backward(d, nullptr) == DDP_SUCCESS;
          if (it >= 2) {  // after the learning pass and first use of every buffer
            hook_allocs += hook;
            iter_allocs += t_allocs - before_iter;
          }
        }
        ddp_destroy(d);
        return ok;
      });
      CHECK(failed == 0);
      CHECK_MESSAGE(hook_allocs.load() == 0, "layout ", layout, " policy ", policy);
      CHECK_MESSAGE(iter_allocs.load() == 0, "layout ", layout, " policy ", policy);
    }
}

TEST_CASE("local group: a rank that never arrives times out, and the context then answers aborted") {
  int failed = on_ranks(2, [](int r, ddp_comm_t c) {
    ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
    cfg.timeout_ms = 300;
    ddp_t d;
    if (ddp_create(c, &cfg, &d) != DDP_SUCCESS) return false;
    std::vector<float> g(10, 1.0f);
    int i;
    ddp_register_grad(d, g.data(), 10, DDP_F32, 0, &i);
    if (ddp_commit(d) != DDP_SUCCESS) return false;
    bool ok = true;
    if (r == 0) {
      auto t0 = std::chrono::steady_clock::now();
      ok = ddp_begin_backward(d, nullptr) == DDP_SUCCESS && ddp_grad_ready(d, i) == DDP_SUCCESS;
      ddp_status_t st = ddp_finish_backward(d, nullptr);
      double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      ok = ok && st == DDP_ERR_TIMEOUT && ms < 3000;
      ok = ok && ddp_begin_backward(d, nullptr) == DDP_ERR_ABORTED;
      ok = ok && std::strstr(ddp_last_error(), "aborted") != nullptr;
    }
    ddp_destroy(d);
    return ok;
  });
  CHECK(failed == 0);
}

TEST_CASE("local group: every agreed config field is compared across ranks and named on every rank") {
  struct Variant {
    const char* field;
    void (*edit)(ddp_config_t*);
  };
  const Variant variants[] = {
      {"message_size", [](ddp_config_t* c) { c->message_size = 77; }},
      {"layout", [](ddp_config_t* c) { c->layout = DDP_LAYOUT_ARENA; }},
      {"delay_allreduce", [](ddp_config_t* c) { c->delay_allreduce = 5; }},
      {"gradient_predivide_factor", [](ddp_config_t* c) { c->gradient_predivide_factor = 3.0; }},
      {"inplace_min_numel", [](ddp_config_t* c) { c->inplace_min_numel = 1000; }},
      {"host_piece_bytes", [](ddp_config_t* c) { c->host_piece_bytes = 1 << 16; }},
  };
  for (const Variant& v : variants) {
    CAPTURE(v.field);
    std::atomic<int> named{0};
    const int failed = on_ranks(3, [&](int rank, ddp_comm_t comm) {
      ddp_config_t cfg;
      ddp_config_init(&cfg);
      cfg.timeout_ms = 20000;
      if (rank == 2) v.edit(&cfg);
      ddp_t d = nullptr;
      const ddp_status_t st = ddp_create(comm, &cfg, &d);
      if (st == DDP_SUCCESS) ddp_destroy(d);
      const std::string msg = ddp_last_error();
      if (st == DDP_ERR_MISMATCH && msg.find(v.field) != std::string::npos && msg.find("rank 2") != std::string::npos)
        ++named;
      return st == DDP_SUCCESS;
    });
    CHECK(failed == 3);  // every rank refuses, none goes on alone
    CHECK(named == 3);
  }
  // A flag is a flag: 1 on one rank and 5 on another agree.
  const int failed = on_ranks(2, [&](int rank, ddp_comm_t comm) {
    ddp_config_t cfg;
    ddp_config_init(&cfg);
    cfg.check_finite = 1;  // not agreed: each rank may scan or not
    cfg.delay_allreduce = rank ? 5 : 1;
    ddp_t d = nullptr;
    const bool ok = ddp_create(comm, &cfg, &d) == DDP_SUCCESS;
    ddp_destroy(d);
    return ok;
  });
  CHECK(failed == 0);
}

// --- the stall inspector on the local comm ----------------------------------------------------

namespace {

std::mutex g_log_mu;
std::vector<std::pair<int, std::string>> g_log_lines;
extern "C" void keep_log(ddp_log_level_t level, const char* message, void*) {
  std::lock_guard<std::mutex> lock(g_log_mu);
  g_log_lines.emplace_back(static_cast<int>(level), message);
}

// Runs a 3-rank iteration in which rank 2 marks its grad `late_ms` after the others.
int late_rank_iteration(int64_t stall_ms, int64_t timeout_ms, int late_ms, std::vector<std::string>* errors) {
  std::mutex mu;
  return on_ranks(3, [&](int r, ddp_comm_t c) {
    ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
    cfg.timeout_ms = timeout_ms;
    cfg.stall_warning_ms = stall_ms;
    cfg.plan_order = DDP_PLAN_REGISTRATION;  // the bucket leaves during backward and waits in a stream
    ddp_t d;
    if (ddp_create(c, &cfg, &d) != DDP_SUCCESS) return false;
    std::vector<float> g(10, 1.0f);
    int i;
    ddp_register_grad(d, g.data(), 10, DDP_F32, 0, &i);
    bool ok = ddp_commit(d) == DDP_SUCCESS && ddp_begin_backward(d, nullptr) == DDP_SUCCESS;
    if (r == 2) std::this_thread::sleep_for(std::chrono::milliseconds(late_ms));
    ok = ok && ddp_grad_ready(d, i) == DDP_SUCCESS;
    ddp_status_t st = ddp_finish_backward(d, nullptr);
    if (st != DDP_SUCCESS) {
      std::lock_guard<std::mutex> lock(mu);
      errors->push_back(ddp_last_error());
    }
    ddp_destroy(d);
    return ok;
  });
}

}  // namespace

TEST_CASE("stall inspector: a late rank is named in one warning through the callback, and the run succeeds") {
  g_log_lines.clear();
  REQUIRE(ddp_set_log_callback(keep_log, nullptr) == DDP_SUCCESS);
  std::vector<std::string> errors;
  CHECK(late_rank_iteration(150, 20000, 600, &errors) == 0);
  REQUIRE(ddp_set_log_callback(nullptr, nullptr) == DDP_SUCCESS);
  CHECK(errors.empty());
  int warnings = 0;
  for (auto& l : g_log_lines)
    if (l.first == DDP_LOG_WARN) {
      ++warnings;
      CAPTURE(l.second);
      CHECK(l.second.find("behind this rank: rank 2") != std::string::npos);
      CHECK(l.second.find("has waited 150 ms") != std::string::npos);
      CHECK(l.second.find("2: iteration 0, in backward") != std::string::npos);
    }
  CHECK(warnings == 2);  // ranks 0 and 1, once each
}

TEST_CASE("stall inspector: a timeout names the rank that is behind and where every rank is") {
  std::vector<std::string> errors;
  CHECK(late_rank_iteration(0, 300, 1500, &errors) == 0);
  REQUIRE(errors.size() >= 2);
  int timed_out = 0;
  for (const std::string& e : errors) {
    CAPTURE(e);
    // The rank whose wait ran out first reports the timeout; the others see their channel aborted.
    if (e.find("past the deadline") == std::string::npos) continue;
    ++timed_out;
    CHECK(e.find("iteration 0, bucket 0 of 1 (stream 0): local") != std::string::npos);  // named once
    CHECK(e.find("behind this rank: rank 2") != std::string::npos);
    CHECK(e.find("(this rank)") != std::string::npos);
  }
  CHECK(timed_out >= 1);
}

TEST_CASE("stall inspector: with no callback and no DDP_DEBUG a clean run prints nothing") {
  REQUIRE(std::getenv("DDP_DEBUG") == nullptr);
  std::fflush(stderr);
  char path[] = "/tmp/ddp_stderr_XXXXXX";
  int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  int saved = dup(2);
  dup2(fd, 2);
  std::vector<std::string> errors;
  const int failed = late_rank_iteration(0, 20000, 0, &errors);
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  const off_t size = lseek(fd, 0, SEEK_END);
  close(fd);
  unlink(path);
  CHECK(failed == 0);
  CHECK(errors.empty());
  CHECK(size == 0);
}
