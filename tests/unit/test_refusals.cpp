// Inputs and disagreements that must be refused or named, never accepted silently: grads over the same
// or overlapping memory, grads not aligned to their dtype; DDP_OP_AVG on self and local comms (sum,
// then scale); timeouts in ddp_commit and ddp_barrier that name the rank that never came; a failed
// hook's peers told which rank failed; ranks that disagree on ddp_set_sync.
#include <doctest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ddp.h"
#include "local_ranks.hpp"

// `st` is `want` and the thread's last error contains `needle`.
#define CHECK_STATUS(call, want, needle) check_status((call), (want), (needle), #call)

namespace {

struct SelfContext {
  ddp_comm_t comm = nullptr;
  ddp_t d = nullptr;
  SelfContext() {
    REQUIRE(ddp_comm_init_self(&comm) == DDP_SUCCESS);
    REQUIRE(ddp_create(comm, nullptr, &d) == DDP_SUCCESS);
  }
  ~SelfContext() {
    ddp_destroy(d);
    ddp_comm_destroy(comm);
  }
};

// A rank's error message and status, kept by the thread that got it.
struct Outcome {
  ddp_status_t status = DDP_SUCCESS;
  std::string message;
  void keep(ddp_status_t st) {
    if (status != DDP_SUCCESS) return;
    status = st;
    if (st != DDP_SUCCESS) message = ddp_last_error();
  }
};

bool has(const std::string& s, const char* needle) { return s.find(needle) != std::string::npos; }

void check_status(ddp_status_t st, ddp_status_t want, const char* needle, const char* call) {
  const std::string error = ddp_last_error();
  CHECK_MESSAGE(st == want, call, " -> ", ddp_status_string(st), ": ", error);
  CHECK_MESSAGE(has(error, needle), error);
}

}  // namespace

TEST_CASE("registration: grads over the same or overlapping memory are refused, naming both") {
  SelfContext c;
  std::vector<float> buf(400, 3.0f);
  int idx = -1;
  REQUIRE(ddp_register_grad(c.d, buf.data(), 100, DDP_F32, 0, &idx) == DDP_SUCCESS);
  CHECK_STATUS(ddp_register_grad(c.d, buf.data(), 100, DDP_F32, 0, &idx), DDP_ERR_INVALID_ARGUMENT,
               "overlaps grad 0 (400 bytes at");
  CHECK(has(ddp_last_error(), "grad 1 (400 bytes at"));
  CHECK(has(ddp_last_error(), "every grad needs memory of its own"));
  // The last element of grad 0, seen as the first of a wider type.
  CHECK_STATUS(ddp_register_grad(c.d, buf.data() + 98, 5, DDP_F64, 0, &idx), DDP_ERR_INVALID_ARGUMENT,
               "grad 1 (40 bytes at");
  CHECK_STATUS(ddp_register_grad(c.d, buf.data() + 50, 1, DDP_F32, 0, &idx), DDP_ERR_INVALID_ARGUMENT,
               "overlaps grad 0");
  // Right after grad 0: its own memory.
  REQUIRE(ddp_register_grad(c.d, buf.data() + 100, 100, DDP_F32, 0, &idx) == DDP_SUCCESS);
  CHECK(idx == 1);
  CHECK_STATUS(ddp_register_grad(c.d, buf.data() + 150, 200, DDP_F32, 0, &idx), DDP_ERR_INVALID_ARGUMENT,
               "grad 2 (800 bytes at");
  CHECK(has(ddp_last_error(), "overlaps grad 1"));
  REQUIRE(ddp_register_grad(c.d, buf.data() + 200, 200, DDP_F32, 0, &idx) == DDP_SUCCESS);
  CHECK(idx == 2);
  // The refusals left the context as it was: each grad is reduced once.
  REQUIRE(ddp_begin_backward(c.d, nullptr) == DDP_SUCCESS);
  for (int g = 0; g < 3; ++g) REQUIRE(ddp_grad_ready(c.d, g) == DDP_SUCCESS);
  REQUIRE(ddp_finish_backward(c.d, nullptr) == DDP_SUCCESS);
  for (float v : buf) CHECK(v == 3.0f);
}

TEST_CASE("registration: two ranks' grads registered twice over one buffer would sum twice: refused") {
  std::mutex mu;
  std::vector<std::string> errors;
  CHECK(on_ranks(2, [&](int rank, ddp_comm_t comm) {
          ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
          cfg.gradient_average = 0;
          cfg.inplace_min_numel = 1;  // reduced in place: a buffer registered twice would be summed twice
          ddp_t d = nullptr;
          if (ddp_create(comm, &cfg, &d) != DDP_SUCCESS) return false;
          std::vector<float> g(64, 1.0f + static_cast<float>(rank));
          int a = -1, b = -1;
          bool ok = ddp_register_grad(d, g.data(), g.size(), DDP_F32, 0, &a) == DDP_SUCCESS;
          ok = ok && ddp_register_grad(d, g.data(), g.size(), DDP_F32, 0, &b) == DDP_ERR_INVALID_ARGUMENT;
          {
            std::lock_guard<std::mutex> lock(mu);
            errors.push_back(ddp_last_error());
          }
          ok = ok && ddp_begin_backward(d, nullptr) == DDP_SUCCESS && ddp_grad_ready(d, a) == DDP_SUCCESS &&
               ddp_finish_backward(d, nullptr) == DDP_SUCCESS;
          for (float v : g) ok = ok && v == 3.0f;  // 1 + 2, once
          ddp_destroy(d);
          return ok;
        }) == 0);
  REQUIRE(errors.size() == 2);
  for (const std::string& e : errors) CHECK(has(e, "grad 1 (256 bytes at"));
}

TEST_CASE("registration: stand-ins (DDP_GRAD_STAND_IN) share one scratch buffer; the real buffers come later") {
  // A framework whose grads do not exist yet registers one scratch buffer for all of them, flagged;
  // ranks may differ in which grads are stand-ins. The real buffers are given before reduction.
  std::mutex mu;
  std::vector<std::string> errors;
  CHECK(on_ranks(2, [&](int rank, ddp_comm_t comm) {
          ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
          cfg.gradient_average = 0;
          ddp_t d = nullptr;
          if (ddp_create(comm, &cfg, &d) != DDP_SUCCESS) return false;
          std::vector<float> scratch(100, 0.0f), a(100, 1.0f + rank), b(40, 10.0f * (1 + rank));
          int ia = -1, ib = -1, ic = -1;
          const unsigned a_flags = rank == 0 ? DDP_GRAD_STAND_IN : 0;  // rank 1 has grad a already
          bool ok =
              ddp_register_grad(d, rank == 0 ? scratch.data() : a.data(), 100, DDP_F32, a_flags, &ia) == DDP_SUCCESS;
          ok = ok && ddp_register_grad(d, scratch.data(), 40, DDP_F32, DDP_GRAD_STAND_IN, &ib) == DDP_SUCCESS;
          // A real grad over a stand-in's scratch is its own memory as far as the library knows.
          std::vector<float> real(8, 0.5f);
          ok = ok && ddp_register_grad(d, real.data(), 8, DDP_F32, 0, &ic) == DDP_SUCCESS;
          // The flag never replaces the overlap check between real grads.
          ok = ok && ddp_register_grad(d, real.data(), 8, DDP_F32, 0, &ic) == DDP_ERR_INVALID_ARGUMENT;
          ok = ok && ddp_set_grad_ptr(d, ib, b.data()) == DDP_SUCCESS;
          ok = ok && ddp_begin_backward(d, nullptr) == DDP_SUCCESS;
          ok = ok && ddp_grad_ready_ptr(d, ia, a.data()) == DDP_SUCCESS && ddp_grad_ready(d, ib) == DDP_SUCCESS &&
               ddp_grad_ready(d, 2) == DDP_SUCCESS;
          ok = ok && ddp_finish_backward(d, nullptr) == DDP_SUCCESS;
          for (float v : a) ok = ok && v == 3.0f;   // 1 + 2
          for (float v : b) ok = ok && v == 30.0f;  // 10 + 20
          for (float v : real) ok = ok && v == 1.0f;
          ddp_destroy(d);
          return ok;
        }) == 0);
  SUBCASE("the flag is for the copy layout, and unknown flags are refused") {
    ddp_comm_t comm = nullptr;
    REQUIRE(ddp_comm_init_self(&comm) == DDP_SUCCESS);
    ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
    cfg.layout = DDP_LAYOUT_ARENA;
    ddp_t d = nullptr;
    REQUIRE(ddp_create(comm, &cfg, &d) == DDP_SUCCESS);
    int idx = -1;
    CHECK_STATUS(ddp_register_grad(d, nullptr, 4, DDP_F32, DDP_GRAD_STAND_IN, &idx), DDP_ERR_INVALID_ARGUMENT,
                 "DDP_GRAD_STAND_IN is for the copy layout");
    CHECK_STATUS(ddp_register_grad(d, nullptr, 4, DDP_F32, 4u, &idx), DDP_ERR_INVALID_ARGUMENT, "unknown flags 0x4");
    ddp_destroy(d);
    ddp_comm_destroy(comm);
  }
}

TEST_CASE("registration: grads not aligned to their dtype are refused, and so are such moved pointers") {
  SelfContext c;
  alignas(16) unsigned char raw[256] = {};
  int idx = -1;
  CHECK_STATUS(ddp_register_grad(c.d, raw + 1, 4, DDP_F32, 0, &idx), DDP_ERR_INVALID_ARGUMENT,
               "is not aligned to its dtype: f32 needs 4-byte alignment");
  CHECK(has(ddp_last_error(), "grad 0 at"));
  CHECK_STATUS(ddp_register_grad(c.d, raw + 4, 4, DDP_F64, 0, &idx), DDP_ERR_INVALID_ARGUMENT,
               "f64 needs 8-byte alignment");
  CHECK_STATUS(ddp_register_grad(c.d, raw + 3, 4, DDP_BF16, 0, &idx), DDP_ERR_INVALID_ARGUMENT,
               "bf16 needs 2-byte alignment");
  REQUIRE(ddp_register_grad(c.d, raw + 2, 4, DDP_F16, 0, &idx) == DDP_SUCCESS);  // 2-byte aligned: fine
  REQUIRE(ddp_register_grad(c.d, raw + 16, 4, DDP_F32, 0, &idx) == DDP_SUCCESS);
  CHECK_STATUS(ddp_set_grad_ptr(c.d, 1, raw + 34), DDP_ERR_INVALID_ARGUMENT, "grad 1 at");
  REQUIRE(ddp_begin_backward(c.d, nullptr) == DDP_SUCCESS);
  CHECK_STATUS(ddp_grad_ready_ptr(c.d, 0, raw + 65), DDP_ERR_INVALID_ARGUMENT, "f16 needs 2-byte alignment");
  REQUIRE(ddp_grad_ready_ptr(c.d, 0, raw + 64) == DDP_SUCCESS);
  REQUIRE(ddp_grad_ready(c.d, 1) == DDP_SUCCESS);
  CHECK(ddp_finish_backward(c.d, nullptr) == DDP_SUCCESS);
}

TEST_CASE("ddp_comm_allreduce: DDP_OP_AVG on a self comm and on a local group sums, then scales") {
  ddp_comm_t self = nullptr;
  REQUIRE(ddp_comm_init_self(&self) == DDP_SUCCESS);
  float v[3] = {2.0f, 4.0f, 6.0f};
  CHECK_STATUS(ddp_comm_allreduce(self, v, 3, DDP_F32, DDP_OP_AVG, nullptr), DDP_SUCCESS, "");
  CHECK(v[0] == 2.0f);
  CHECK(v[2] == 6.0f);
  ddp_comm_destroy(self);
  CHECK(on_ranks(4, [](int rank, ddp_comm_t comm) {
          std::vector<double> d(100, static_cast<double>(rank + 1));
          std::vector<float> f(7, static_cast<float>(2 * rank));
          bool ok = ddp_comm_allreduce(comm, d.data(), d.size(), DDP_F64, DDP_OP_AVG, nullptr) == DDP_SUCCESS &&
                    ddp_comm_allreduce(comm, f.data(), f.size(), DDP_F32, DDP_OP_AVG, nullptr) == DDP_SUCCESS;
          for (double x : d) ok = ok && x == 2.5;  // (1 + 2 + 3 + 4) / 4
          for (float x : f) ok = ok && x == 3.0f;  // (0 + 2 + 4 + 6) / 4
          return ok;
        }) == 0);
}

namespace {

extern "C" ddp_status_t averaging_hook(const ddp_hook_bucket_t* b, void*) {
  return ddp_comm_allreduce(b->comm, b->buffer, b->count, b->dtype, DDP_OP_AVG, b->stream);
}

// Rank 0's hook fails; the others average and so wait for it.
extern "C" ddp_status_t failing_hook(const ddp_hook_bucket_t* b, void*) {
  if (b->rank == 0) return DDP_ERR_INVALID_ARGUMENT;
  return ddp_comm_allreduce(b->comm, b->buffer, b->count, b->dtype, DDP_OP_AVG, b->stream);
}

// One iteration of one grad of 33 floats holding rank + 1, through `hook`.
Outcome hooked_iteration(ddp_comm_t comm, int rank, ddp_comm_hook_fn hook, std::vector<float>* g) {
  Outcome o;
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.timeout_ms = 20000;
  ddp_t d = nullptr;
  g->assign(33, static_cast<float>(rank + 1));
  int idx = -1;
  o.keep(ddp_create(comm, &cfg, &d));
  if (o.status == DDP_SUCCESS) {
    o.keep(ddp_set_comm_hook(d, hook, nullptr));
    o.keep(ddp_register_grad(d, g->data(), g->size(), DDP_F32, 0, &idx));
    o.keep(ddp_begin_backward(d, nullptr));
    o.keep(ddp_grad_ready(d, idx));
    o.keep(ddp_finish_backward(d, nullptr));
  }
  ddp_destroy(d);
  return o;
}

}  // namespace

TEST_CASE("comm hook: a hook that averages with DDP_OP_AVG works on a local group") {
  CHECK(on_ranks(3, [](int rank, ddp_comm_t comm) {
          std::vector<float> g;
          const Outcome o = hooked_iteration(comm, rank, averaging_hook, &g);
          bool ok = o.status == DDP_SUCCESS;
          for (float x : g) ok = ok && x == 2.0f;  // (1 + 2 + 3) / 3
          if (!ok) MESSAGE(o.message);
          return ok;
        }) == 0);
}

TEST_CASE("comm hook: when one rank's hook fails, its peers on a local group are told which rank") {
  std::mutex mu;
  std::vector<Outcome> out(3);
  on_ranks(3, [&](int rank, ddp_comm_t comm) {
    std::vector<float> g;
    const Outcome o = hooked_iteration(comm, rank, failing_hook, &g);
    std::lock_guard<std::mutex> lock(mu);
    out[static_cast<size_t>(rank)] = o;
    return true;
  });
  CHECK(out[0].status == DDP_ERR_ABORTED);
  CHECK(has(out[0].message, "comm hook returned"));
  for (int r = 1; r < 3; ++r) {
    CAPTURE(out[static_cast<size_t>(r)].message);
    CHECK(out[static_cast<size_t>(r)].status == DDP_ERR_ABORTED);
    CHECK(has(out[static_cast<size_t>(r)].message, "aborted by rank 0 of 3"));
  }
}

namespace {

// Rank 0 calls `call` with a short timeout; rank 1 never does (it waits past the timeout, its context
// alive and answering the stall inspector, then destroys it). With `commit_first` both commit before.
template <class Call>
Outcome lonely_call(bool commit_first, Call call) {
  Outcome o;
  on_ranks(2, [&](int rank, ddp_comm_t comm) {
    ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
    cfg.timeout_ms = 300;
    ddp_t d = nullptr;
    if (ddp_create(comm, &cfg, &d) != DDP_SUCCESS) return false;
    std::vector<float> g(8);
    int idx = -1;
    bool ok = ddp_register_grad(d, g.data(), g.size(), DDP_F32, 0, &idx) == DDP_SUCCESS;
    if (commit_first) ok = ok && ddp_commit(d) == DDP_SUCCESS;
    if (rank == 0)
      o.keep(call(d));
    else
      std::this_thread::sleep_for(std::chrono::milliseconds(1200));
    ddp_destroy(d);
    return ok;
  });
  return o;
}

}  // namespace

TEST_CASE("ddp_commit: a timeout names the rank that never committed") {
  const Outcome o = lonely_call(false, [](ddp_t d) { return ddp_commit(d); });
  CAPTURE(o.message);
  CHECK(o.status == DDP_ERR_TIMEOUT);
  CHECK(has(o.message, "behind this rank: rank 1"));
  CHECK(has(o.message, "0 (this rank): iteration 0, in ddp_commit"));
  CHECK(!has(o.message, "none is behind"));
}

TEST_CASE("ddp_barrier: after a common commit, a timeout names the rank that never came to the barrier") {
  const Outcome o = lonely_call(true, [](ddp_t d) { return ddp_barrier(d); });
  CAPTURE(o.message);
  CHECK(o.status == DDP_ERR_TIMEOUT);
  CHECK(has(o.message, "behind this rank: rank 1"));
  CHECK(has(o.message, "in ddp_barrier"));
  CHECK(!has(o.message, "none is behind"));
}

namespace {

// Rank 1 runs one backward pass with sync off before its synced one; rank 0 only the synced one.
std::vector<Outcome> sync_disagreement(const ddp_config_t& cfg) {
  std::mutex mu;
  std::vector<Outcome> out(2);
  on_ranks(2, [&](int rank, ddp_comm_t comm) {
    Outcome o;
    ddp_t d = nullptr;
    std::vector<float> g(16, 1.0f);
    int idx = -1;
    o.keep(ddp_create(comm, &cfg, &d));
    if (o.status == DDP_SUCCESS) o.keep(ddp_register_grad(d, g.data(), g.size(), DDP_F32, 0, &idx));
    if (rank == 1 && o.status == DDP_SUCCESS) {
      o.keep(ddp_set_sync(d, 0));
      o.keep(ddp_begin_backward(d, nullptr));
      o.keep(ddp_grad_ready(d, idx));
      o.keep(ddp_finish_backward(d, nullptr));
      o.keep(ddp_set_sync(d, 1));
    }
    if (o.status == DDP_SUCCESS) {
      o.keep(ddp_begin_backward(d, nullptr));
      if (o.status == DDP_SUCCESS) o.keep(ddp_grad_ready(d, idx));
      if (o.status == DDP_SUCCESS) o.keep(ddp_finish_backward(d, nullptr));
    }
    ddp_destroy(d);
    std::lock_guard<std::mutex> lock(mu);
    out[static_cast<size_t>(rank)] = o;
    return true;
  });
  return out;
}

}  // namespace

TEST_CASE("ddp_set_sync: ranks that disagree fail with DDP_ERR_MISMATCH at the first synced iteration") {
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.timeout_ms = 20000;
  SUBCASE("the unused-grad report finds it, after the buckets") {}
  SUBCASE("the uneven-inputs vote finds it, before any bucket") {
    cfg.uneven_inputs = DDP_UNEVEN_BY_WORLD;
    cfg.unused_policy = DDP_UNUSED_ZERO;
  }
  for (const Outcome& o : sync_disagreement(cfg)) {
    CAPTURE(o.message);
    CHECK(o.status == DDP_ERR_MISMATCH);
    CHECK(has(o.message, "ranks disagree on ddp_set_sync"));
    CHECK(has(o.message, "before this synced iteration: rank 0: 0; rank 1: 1"));
  }
}

TEST_CASE(
    "elastic: refused where the communicator cannot be rebuilt (self); made over a local group; ddp_recover on a "
    "context not elastic is refused") {
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.elastic = 1;
  ddp_comm_t self;
  REQUIRE(ddp_comm_init_self(&self) == DDP_SUCCESS);
  // (MPI and NCCL refuse elastic contexts by name: the features suite checks them.) A self comm is a
  // local group of one: elastic, with nobody to lose.
  ddp_t d = nullptr;
  REQUIRE(ddp_create(self, &cfg, &d) == DDP_SUCCESS);
  ddp_membership_t none;
  CHECK_STATUS(ddp_recover(d, &none, nullptr, 0), DDP_ERR_INVALID_STATE, "no rank was lost and none waits to join");
  ddp_destroy(d);
  // A context that is not elastic: nothing to recover.
  REQUIRE(ddp_create(self, nullptr, &d) == DDP_SUCCESS);
  ddp_membership_t m;
  CHECK_STATUS(ddp_recover(d, &m, nullptr, 0), DDP_ERR_INVALID_STATE, "not elastic");
  int members[4];
  CHECK_STATUS(ddp_recover(d, &m, nullptr, 4), DDP_ERR_INVALID_ARGUMENT, "members is NULL with capacity 4");
  CHECK_STATUS(ddp_recover(nullptr, &m, members, 4), DDP_ERR_INVALID_ARGUMENT, "");
  ddp_destroy(d);
  // Local groups are rebuilt (test_elastic_local.cpp): an elastic context over one is made.
  CHECK(on_ranks(2, [&](int, ddp_comm_t comm) {
          ddp_t e = nullptr;
          const bool ok = ddp_create(comm, &cfg, &e) == DDP_SUCCESS;
          ddp_destroy(e);
          return ok;
        }) == 0);
  ddp_comm_destroy(self);
  CHECK(std::string(ddp_status_string(DDP_ERR_RANK_LOST)) == "a rank was lost: call ddp_recover");
  CHECK(std::string(ddp_status_string(DDP_ERR_RANK_JOINING)) == "a rank waits to join: call ddp_recover");
}
