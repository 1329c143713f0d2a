// ddp_grad_ready from several threads at once, inside one process (a local group: every rank is a
// thread, and every rank has several marker threads, as autograd engines do). Built without MPI so
// that it runs under TSan. Each configuration runs the same iterations twice, once with one marker
// thread per rank and once with several, and the grads must be bitwise the same and equal to the
// reference. Prints "threads: N passed, N failed".
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "../support/exact_grads.hpp"

using namespace faults;

namespace {

constexpr int kRanks = 3, kGrads = 30, kIters = 3;
int g_passed = 0, g_failed = 0;

struct Outcome {
  bool ok = true;
  std::string why;
  std::vector<std::vector<unsigned char>> result;  // per iteration: every grad's bytes
};

void rank_main(ddp_local_group_t group, int rank, const ddp_config_t& cfg, int markers, Outcome* out) {
  auto fail = [&](const std::string& why) {
    if (out->ok) out->ok = false, out->why = "rank " + std::to_string(rank) + ": " + why;
  };
  ddp_comm_t comm = nullptr;
  ddp_t d = nullptr;
  if (ddp_comm_init_local(group, rank, &comm) || ddp_create(comm, &cfg, &d)) return fail(ddp_last_error());
  ddp_comm_destroy(comm);
  std::vector<Grad> grads = make_grads(kGrads);
  const bool arena = cfg.layout == DDP_LAYOUT_ARENA;
  for (Grad& g : grads)
    if (ddp_register_grad(d, arena ? nullptr : g.buf.data(), g.numel, g.dtype, 0, &g.index))
      return fail(ddp_last_error());
  for (int it = 0; it < kIters && out->ok; ++it) {
    if (ddp_begin_backward(d, nullptr)) return fail(ddp_last_error());
    std::vector<void*> ptr(kGrads);
    for (int g = 0; g < kGrads; ++g) {
      ddp_grad_ptr(d, g, &ptr[g]);
      for (size_t i = 0; i < grads[g].numel; ++i) store(ptr[g], i, grads[g].dtype, value(7, rank, it, g, i));
    }
    // Marker t takes every markers-th grad, from the last one down; all start together.
    std::vector<std::thread> ts;
    std::vector<int> bad(static_cast<size_t>(markers), 0);
    for (int t = 0; t < markers; ++t)
      ts.emplace_back([&, t] {
        for (int g = kGrads - 1 - t; g >= 0; g -= markers)
          if (ddp_grad_ready(d, g) != DDP_SUCCESS) bad[static_cast<size_t>(t)] = 1;
      });
    for (auto& th : ts) th.join();
    for (int b : bad)
      if (b) fail("ddp_grad_ready failed in a marker thread");
    if (ddp_finish_backward(d, nullptr)) return fail(ddp_last_error());
    std::vector<unsigned char> bytes;
    for (int g = 0; g < kGrads; ++g) {
      ddp_grad_ptr(d, g, &ptr[g]);
      const unsigned char* p = static_cast<const unsigned char*>(ptr[g]);
      bytes.insert(bytes.end(), p, p + grads[g].numel * esize(grads[g].dtype));
      for (size_t i = 0; i < grads[g].numel && out->ok; ++i) {
        double sum = 0;
        for (int r = 0; r < kRanks; ++r) sum += value(7, r, it, g, i);
        const double want = sum / kRanks, got = load(ptr[g], i, grads[g].dtype);
        const double tol = grads[g].dtype == DDP_F64   ? 1e-12
                           : grads[g].dtype == DDP_F32 ? 1e-6
                           : grads[g].dtype == DDP_F16 ? 1e-3
                                                       : 8e-3;
        if (!(std::fabs(got - want) <= tol * std::max(1.0, std::fabs(want))))
          fail("grad " + std::to_string(g) + " wrong after iteration " + std::to_string(it));
      }
    }
    out->result.push_back(std::move(bytes));
  }
  ddp_destroy(d);
}

void run(const char* name, const ddp_config_t& cfg) {
  std::vector<Outcome> one(kRanks), many(kRanks);
  for (int markers : {1, 4}) {
    std::vector<Outcome>& outs = markers == 1 ? one : many;
    ddp_local_group_t group = nullptr;
    ddp_local_group_create(kRanks, &group);
    std::vector<std::thread> ranks;
    for (int r = 0; r < kRanks; ++r) ranks.emplace_back(rank_main, group, r, std::cref(cfg), markers, &outs[r]);
    for (auto& t : ranks) t.join();
    ddp_local_group_destroy(group);
  }
  bool ok = true;
  std::string why;
  for (int r = 0; r < kRanks && ok; ++r) {
    if (!one[r].ok || !many[r].ok)
      ok = false, why = one[r].ok ? many[r].why : one[r].why;
    else if (one[r].result != many[r].result)
      ok = false, why = "rank " + std::to_string(r) + ": 4 marker threads gave other bytes than 1";
    else if (many[r].result != many[0].result)
      ok = false, why = "ranks hold different results";
  }
  std::printf("%s threads %s%s%s\n", ok ? "ok  " : "FAIL", name, ok ? "" : ": ", why.c_str());
  ok ? ++g_passed : ++g_failed;
}

}  // namespace

int main() {
  for (int layout = 0; layout < 2; ++layout)
    for (int plan = 0; plan < 2; ++plan)
      for (int streams : {1, 3}) {
        ddp_config_t cfg;
        ddp_config_init(&cfg);
        cfg.layout = layout;
        cfg.plan_order = plan;
        cfg.num_streams = streams;
        cfg.message_size = 2000;
        cfg.timeout_ms = 60000;
        char name[96];
        std::snprintf(name, sizeof name, "layout=%s plan=%s streams=%d", layout ? "arena" : "copy",
                      plan ? "registration" : "learned", streams);
        run(name, cfg);
      }
  std::printf("threads: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
