// Elastic contexts over a local group (ranks as threads): a random rank is lost at a random point of
// a random iteration (its context destroyed between iterations, found at timeout_ms; destroyed in the
// middle of its backward pass, found at once; or stalled past the others' wait, then told it was left
// out); the others recover and finish. Every survivor's parameters must be bitwise equal to the
// others' and equal (to float rounding) a float64 replay driven by the membership log. Under the
// thread sanitizer this is the elastic path's race check.
#include <doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ddp.h"

namespace {

constexpr int kSteps = 6;
constexpr double kLr = 0.05;
constexpr int64_t kTimeoutMs = 600;
enum Fault { DestroyIdle, DestroyInBackward, Stall };

struct LocalScenario {
  int np = 3, victim = 0, step = 0, fault = 0, ready = 0, layout = 0, streams = 1;
  std::vector<size_t> sizes;
};

float grad_of(int id, int step, size_t g, size_t i) {
  uint64_t h = (static_cast<uint64_t>(id) * 7919u + static_cast<uint64_t>(step) * 104729u + g * 131u + i) *
               0x9e3779b97f4a7c15ull;
  h ^= h >> 31;
  return static_cast<float>(static_cast<int>(h % 2001) - 1000) / 1000.0f;
}
float start_of(size_t g, size_t i) { return static_cast<float>((g * 17 + i) % 23) / 23.0f; }

struct Outcome {
  bool survivor = false;
  std::string log, error;
  std::vector<float> params;
};

// Rank `id`'s run: the log "K:ids;" of each committed step and its final parameters.
void rank_run(const LocalScenario& s, ddp_local_group_t group, int id, Outcome* out) {
  auto failed = [&](const char* what, ddp_status_t st) {
    out->error = std::string(what) + ": " + ddp_status_string(st) + ": " + ddp_last_error();
  };
  ddp_comm_t comm = nullptr;
  ddp_status_t st = ddp_comm_init_local(group, id, &comm);
  if (st) return failed("comm", st);
  ddp_config_t cfg;
  ddp_config_init(&cfg);
  cfg.elastic = 1;
  cfg.timeout_ms = kTimeoutMs;
  cfg.layout = s.layout;
  cfg.num_streams = s.streams;
  cfg.message_size = 2000;
  cfg.unused_policy = DDP_UNUSED_ZERO;
  ddp_t d = nullptr;
  if ((st = ddp_create(comm, &cfg, &d))) return failed("create", st);
  ddp_comm_destroy(comm);
  const size_t ng = s.sizes.size();
  std::vector<std::vector<float>> params(ng), own(ng);
  std::vector<float*> grads(ng);
  for (size_t g = 0; g < ng; ++g) {
    own[g].resize(s.sizes[g]);
    for (size_t i = 0; i < s.sizes[g]; ++i) params[g].push_back(start_of(g, i));
    int index = 0;
    if ((st = ddp_register_grad(d, s.layout ? nullptr : own[g].data(), s.sizes[g], DDP_F32, 0, &index)))
      return failed("register", st);
  }
  auto find_grads = [&] {
    for (size_t g = 0; g < ng; ++g) {
      void* p = nullptr;
      ddp_grad_ptr(d, static_cast<int>(g), &p);
      grads[g] = static_cast<float*>(p);
    }
  };
  find_grads();
  std::vector<int> ids;
  for (int r = 0; r < s.np; ++r) ids.push_back(r);
  std::ostringstream log;
  std::mt19937 order(static_cast<unsigned>(id + 1));
  for (int64_t step = 0; step < kSteps;) {
    const bool faults = id == s.victim && step == s.step;
    if (faults && s.fault == DestroyIdle) return (void)ddp_destroy(d);
    if (faults && s.fault == Stall) std::this_thread::sleep_for(std::chrono::milliseconds(3 * kTimeoutMs));
    st = ddp_begin_backward(d, nullptr);
    std::vector<size_t> o(ng);
    for (size_t g = 0; g < ng; ++g) o[g] = g;
    std::shuffle(o.begin(), o.end(), order);
    for (size_t k = 0; k < ng && st == DDP_SUCCESS; ++k) {
      if (faults && s.fault == DestroyInBackward && static_cast<int>(k) == s.ready) return (void)ddp_destroy(d);
      for (size_t i = 0; i < s.sizes[o[k]]; ++i) grads[o[k]][i] = grad_of(id, static_cast<int>(step), o[k], i);
      st = ddp_grad_ready(d, static_cast<int>(o[k]));
    }
    if (st == DDP_SUCCESS) st = ddp_finish_backward(d, nullptr);
    if (st == DDP_SUCCESS) {
      find_grads();
      for (size_t g = 0; g < ng; ++g)
        for (size_t i = 0; i < s.sizes[g]; ++i) params[g][i] -= static_cast<float>(kLr) * grads[g][i];
      log << step << ":";
      for (int x : ids) log << x << ",";
      log << ";";
      ++step;
      continue;
    }
    if (st != DDP_ERR_RANK_LOST) return failed("step", st);
    ddp_membership_t m;
    std::vector<int> members(static_cast<size_t>(s.np), -1);
    st = ddp_recover(d, &m, members.data(), members.size());
    if (st == DDP_ERR_RANK_LOST && id == s.victim && std::strstr(ddp_last_error(), "left out")) {
      out->error = "left out";  // the stalled rank, told so
      return (void)ddp_destroy(d);
    }
    if (st) return failed("recover", st);
    const std::vector<int> before = ids;
    ids.clear();
    for (int i = 0; i < m.world; ++i) ids.push_back(before[static_cast<size_t>(members[static_cast<size_t>(i)])]);
    std::vector<void*> bufs;
    std::vector<size_t> counts;
    std::vector<ddp_dtype_t> types;
    for (size_t g = 0; g < ng; ++g)
      bufs.push_back(params[g].data()), counts.push_back(s.sizes[g]), types.push_back(DDP_F32);
    if ((st = ddp_broadcast(d, bufs.data(), counts.data(), types.data(), static_cast<int>(ng), m.source, nullptr)))
      return failed("broadcast", st);
    for (; step < m.committed; ++step) {  // committed by the old world without this rank
      log << step << ":";
      for (int x : before) log << x << ",";
      log << ";";
    }
    find_grads();
  }
  out->survivor = true;
  out->log = log.str();
  for (auto& p : params) out->params.insert(out->params.end(), p.begin(), p.end());
  ddp_destroy(d);
}

// "" when the scenario passed, else why not.
std::string run_local(const LocalScenario& s) {
  ddp_local_group_t group;
  if (ddp_local_group_create(s.np, &group)) return "no group";
  std::vector<Outcome> out(static_cast<size_t>(s.np));
  std::vector<std::thread> ts;
  for (int r = 0; r < s.np; ++r) ts.emplace_back(rank_run, std::cref(s), group, r, &out[static_cast<size_t>(r)]);
  for (auto& t : ts) t.join();
  ddp_local_group_destroy(group);
  const Outcome* ref = nullptr;
  for (int r = 0; r < s.np; ++r) {
    const Outcome& o = out[static_cast<size_t>(r)];
    if (r == s.victim) {
      if (s.fault == Stall && o.error != "left out") return "the stalled rank was not told it was left out: " + o.error;
      continue;
    }
    if (!o.survivor) return "rank " + std::to_string(r) + ": " + o.error;
    if (!ref) ref = &o;
    if (o.log != ref->log) return "membership logs differ: " + ref->log + " against " + o.log;
    if (std::memcmp(o.params.data(), ref->params.data(), o.params.size() * sizeof(float)) != 0)
      return "the survivors' parameters differ";
  }
  // The float64 replay of the log.
  std::vector<double> p;
  for (size_t g = 0; g < s.sizes.size(); ++g)
    for (size_t i = 0; i < s.sizes[g]; ++i) p.push_back(start_of(g, i));
  std::istringstream in(ref->log);
  std::string entry;
  int steps = 0;
  while (std::getline(in, entry, ';')) {
    const int k = std::atoi(entry.c_str());
    if (k != steps++) return "the log skips a step: " + ref->log;
    std::vector<int> who;
    std::istringstream ws(entry.substr(entry.find(':') + 1));
    for (std::string x; std::getline(ws, x, ',');) who.push_back(std::atoi(x.c_str()));
    size_t at = 0;
    for (size_t g = 0; g < s.sizes.size(); ++g)
      for (size_t i = 0; i < s.sizes[g]; ++i, ++at) {
        double sum = 0;
        for (int x : who) sum += grad_of(x, k, g, i);
        p[at] -= kLr * (sum / static_cast<double>(who.size()));
      }
  }
  if (steps != kSteps) return "the log holds " + std::to_string(steps) + " steps";
  for (size_t i = 0; i < p.size(); ++i)
    if (!(std::fabs(p[i] - ref->params[i]) <= 1e-5)) return "off the float64 replay at element " + std::to_string(i);
  return "";
}

}  // namespace

TEST_CASE("elastic over a local group: a rank lost at a random point, the others recover exactly") {
  const unsigned seed = static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count() % 100000);
  std::mt19937 rng(seed);
  for (int k = 0; k < 9; ++k) {
    LocalScenario s;
    s.np = 3 + static_cast<int>(rng() % 2);
    s.victim = static_cast<int>(rng() % static_cast<unsigned>(s.np));
    s.step = static_cast<int>(rng() % (kSteps - 2));
    s.fault = k % 3;  // each kind three times
    s.layout = static_cast<int>(rng() % 2);
    s.streams = 1 + static_cast<int>(rng() % 2);
    const int ng = 2 + static_cast<int>(rng() % 3);
    for (int g = 0; g < ng; ++g) s.sizes.push_back(1 + rng() % 5000);
    s.ready = static_cast<int>(rng() % static_cast<unsigned>(ng));
    INFO("seed " << seed << ", scenario " << k << ": np " << s.np << ", rank " << s.victim << " at step " << s.step
                 << ", fault " << s.fault << ", layout " << s.layout << ", streams " << s.streams);
    CHECK(run_local(s) == "");
  }
}
