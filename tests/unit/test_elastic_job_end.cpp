// Elastic joins when the job ends first: every rank of the job destroys its context while a joiner
// waits to be admitted. The joiner must hear of it at once (DDP_ERR_ABORTED, saying the job ended)
// instead of waiting out its join bound; a later job over the same store must still admit joiners
// (the first job's end is not taken for its own), and so must a job that one rank left early. Ranks
// and joiners are threads over a file:// store.
#include <doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "ddp.h"

namespace {

bool gloo_built() {
  ddp_comm_t c = nullptr;
  return ddp_comm_init_gloo("bogus://", 0, 1, &c) != DDP_ERR_UNSUPPORTED;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

struct Store {
  std::string dir, method;
  Store() {
    char tmpl[] = "/tmp/ddp-jobend-XXXXXX";
    dir = mkdtemp(tmpl);
    method = "file://" + dir;
  }
  ~Store() { std::system(("rm -rf " + dir).c_str()); }
};

ddp_config_t elastic_config() {
  ddp_config_t cfg;
  ddp_config_init(&cfg);
  cfg.elastic = 1;
  cfg.timeout_ms = 20000;
  return cfg;
}

constexpr size_t kNumel = 1000;

// A rank of a job of two. Without `admit` the job ends at the step boundary where a joiner waits
// (every rank sees DDP_ERR_RANK_JOINING there); with it, the joiner is admitted and the job ends
// after 3 steps with it. Returns the world it ended in (0: failed, with `error`).
int train(const std::string& method, int r, bool admit, std::string* error) {
  const ddp_config_t cfg = elastic_config();
  ddp_comm_t c = nullptr;
  ddp_t d = nullptr;
  std::vector<float> g(kNumel);
  int index = 0, world = 2, steps_at_three = 0;
  if (ddp_comm_init_gloo_timeout(method.c_str(), r, 2, 20000, &c) || ddp_create(c, &cfg, &d) ||
      ddp_register_grad(d, g.data(), g.size(), DDP_F32, 0, &index))
    return *error = std::string("create: ") + ddp_last_error(), 0;
  for (int it = 0; it < 2000 && steps_at_three < 3; ++it) {
    const ddp_status_t st = ddp_begin_backward(d, nullptr);
    if (st == DDP_ERR_RANK_JOINING && !admit) break;  // the job ends here, the joiner not admitted
    if (st == DDP_ERR_RANK_JOINING) {
      ddp_membership_t m;
      if (ddp_recover(d, &m, nullptr, 0)) return *error = std::string("recover: ") + ddp_last_error(), 0;
      world = m.world;
      continue;
    }
    std::fill(g.begin(), g.end(), 1.0f);
    if (st || ddp_grad_ready(d, index) || ddp_finish_backward(d, nullptr))
      return *error = std::string("step: ") + ddp_last_error(), 0;
    if (world == 3) ++steps_at_three;
    std::this_thread::sleep_for(std::chrono::milliseconds(world == 3 ? 0 : 20));
  }
  ddp_destroy(d);
  ddp_comm_destroy(c);
  return world;
}

}  // namespace

TEST_CASE("elastic joins: the job's end reaches a waiting joiner at once, and a later job over the store admits") {
  if (!gloo_built()) return;
  const Store store;
  const ddp_config_t cfg = elastic_config();
  // Job A ends while the joiner waits: its ddp_recover returns within seconds, not its 20 s bound.
  std::string errors[2];
  int worlds[2] = {0, 0};
  std::thread ranks[2];
  for (int r = 0; r < 2; ++r) ranks[r] = std::thread([&, r] { worlds[r] = train(store.method, r, false, &errors[r]); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ddp_comm_t jc = nullptr;
  REQUIRE(ddp_comm_join_gloo(store.method.c_str(), 20000, &jc) == DDP_SUCCESS);
  ddp_t j = nullptr;
  REQUIRE(ddp_create(jc, &cfg, &j) == DDP_SUCCESS);
  std::vector<float> g(kNumel);
  int index = 0;
  REQUIRE(ddp_register_grad(j, g.data(), g.size(), DDP_F32, 0, &index) == DDP_SUCCESS);
  std::chrono::steady_clock::time_point ended;
  std::thread ender([&] {
    for (std::thread& t : ranks) t.join();
    ended = std::chrono::steady_clock::now();
  });
  const auto asked = std::chrono::steady_clock::now();
  const ddp_status_t st = ddp_recover(j, nullptr, nullptr, 0);
  const std::string msg = ddp_last_error();
  const double waited = seconds_since(asked);
  ender.join();
  INFO("joiner: " << ddp_status_string(st) << ": " << msg << " (after " << waited << " s)");
  CHECK(errors[0] == "");
  CHECK(errors[1] == "");
  CHECK(worlds[0] == 2);
  CHECK(st == DDP_ERR_ABORTED);
  CHECK(msg.find("ddp_recover: the job at " + store.method + " ended before admitting this process") !=
        std::string::npos);
  CHECK(msg.find("there is no job left to join; destroy this context") != std::string::npos);
  CHECK(waited < 8.0);                    // the job saw the request, ended at its next step boundary
  CHECK(seconds_since(ended) <= waited);  // (and the joiner returned after that end)
  CHECK(seconds_since(ended) < 3.0);
  // The context is over: every call says so, ddp_recover included.
  CHECK(ddp_recover(j, nullptr, nullptr, 0) == DDP_ERR_ABORTED);
  CHECK(std::string(ddp_last_error()).find("ended before admitting this process") != std::string::npos);
  CHECK(ddp_begin_backward(j, nullptr) == DDP_ERR_ABORTED);
  ddp_destroy(j);
  ddp_comm_destroy(jc);

  // Job B over the same store: job A's end is not its own; its joiner is admitted and trains with it.
  for (int r = 0; r < 2; ++r) ranks[r] = std::thread([&, r] { worlds[r] = train(store.method, r, true, &errors[r]); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  int joined_world = 0, steps = 0;
  double admitted_after = -1;
  ddp_comm_t c = nullptr;
  ddp_t d = nullptr;
  ddp_membership_t m;
  const auto b_asked = std::chrono::steady_clock::now();
  if (ddp_comm_join_gloo(store.method.c_str(), 20000, &c) || ddp_create(c, &cfg, &d) ||
      ddp_register_grad(d, g.data(), g.size(), DDP_F32, 0, &index) || ddp_recover(d, &m, nullptr, 0)) {
    MESSAGE("job B's joiner: " << ddp_last_error());
  } else {
    joined_world = m.world;
    admitted_after = seconds_since(b_asked);
    for (; steps < 3; ++steps) {  // as many as the job's ranks make at three
      std::fill(g.begin(), g.end(), 1.0f);
      if (ddp_begin_backward(d, nullptr) || ddp_grad_ready(d, index) || ddp_finish_backward(d, nullptr)) break;
    }
  }
  for (std::thread& t : ranks) t.join();
  ddp_destroy(d);
  ddp_comm_destroy(c);
  CHECK(joined_world == 3);
  CHECK(admitted_after < 8.0);  // not held up by job A's joiner (the job waits 10 s for an admitted one)
  CHECK(steps == 3);
  CHECK(worlds[0] == 3);
  CHECK(worlds[1] == 3);
  CHECK(errors[0] == "");
  CHECK(errors[1] == "");
}

// The job ends only when every member of its membership has left: one rank that destroys its context
// while the others go on is a loss (they recover without it), and a joiner that comes later is admitted.
TEST_CASE("elastic joins: a rank that leaves early does not end the job for joiners") {
  if (!gloo_built()) return;
  const Store store;
  const ddp_config_t cfg = elastic_config();
  std::atomic<bool> left{false};
  std::string errors[3];
  int worlds[3] = {0, 0, 0};
  auto rank_run = [&](int r) {
    ddp_comm_t c = nullptr;
    ddp_t d = nullptr;
    std::vector<float> g(kNumel);
    int index = 0, world = 3, steps_at_three = 0;
    bool lost = false;
    if (ddp_comm_init_gloo_timeout(store.method.c_str(), r, 3, 20000, &c) || ddp_create(c, &cfg, &d) ||
        ddp_register_grad(d, g.data(), g.size(), DDP_F32, 0, &index)) {
      errors[r] = std::string("create: ") + ddp_last_error();
      return;
    }
    for (int it = 0; it < 2000 && steps_at_three < 3; ++it) {
      if (r == 2 && it == 2) break;  // leaves the job: its context destroyed, the others go on
      ddp_status_t st = ddp_begin_backward(d, nullptr);
      if (st == DDP_SUCCESS) {
        std::fill(g.begin(), g.end(), 1.0f);
        st = ddp_grad_ready(d, index);
        if (st == DDP_SUCCESS) st = ddp_finish_backward(d, nullptr);
      }
      if (st == DDP_ERR_RANK_LOST || st == DDP_ERR_RANK_JOINING) {
        lost = lost || st == DDP_ERR_RANK_LOST;
        ddp_membership_t m;
        if (ddp_recover(d, &m, nullptr, 0)) {
          errors[r] = std::string("recover: ") + ddp_last_error();
          break;
        }
        world = m.world;
        continue;
      }
      if (st) {
        errors[r] = std::string("step: ") + ddp_last_error();
        break;
      }
      if (world == 3 && lost) ++steps_at_three;
      std::this_thread::sleep_for(std::chrono::milliseconds(lost && world == 3 ? 0 : 20));
    }
    worlds[r] = world;
    ddp_destroy(d);
    ddp_comm_destroy(c);
    if (r == 2) left = true;
  };
  std::thread ranks[3];
  for (int r = 0; r < 3; ++r) ranks[r] = std::thread(rank_run, r);
  while (!left.load()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ddp_comm_t c = nullptr;
  ddp_t d = nullptr;
  std::vector<float> g(kNumel);
  int index = 0, steps = 0;
  ddp_membership_t m{};
  const ddp_status_t made = ddp_comm_join_gloo(store.method.c_str(), 20000, &c);
  ddp_status_t st = made ? made : ddp_create(c, &cfg, &d);
  if (st == DDP_SUCCESS) st = ddp_register_grad(d, g.data(), g.size(), DDP_F32, 0, &index);
  if (st == DDP_SUCCESS) st = ddp_recover(d, &m, nullptr, 0);
  INFO("joiner: " << ddp_status_string(st) << ": " << ddp_last_error());
  CHECK(st == DDP_SUCCESS);
  for (; st == DDP_SUCCESS && steps < 3; ++steps) {
    std::fill(g.begin(), g.end(), 1.0f);
    if (ddp_begin_backward(d, nullptr) || ddp_grad_ready(d, index) || ddp_finish_backward(d, nullptr)) break;
  }
  for (std::thread& t : ranks) t.join();
  ddp_destroy(d);
  ddp_comm_destroy(c);
  CHECK(m.world == 3);
  CHECK(steps == 3);
  CHECK(worlds[0] == 3);
  CHECK(worlds[1] == 3);
  for (const std::string& e : errors) CHECK(e == "");
}
