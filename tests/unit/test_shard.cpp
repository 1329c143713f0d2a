// Sharded contexts through the C API: refused combinations and every misuse answer a status and a
// message; on one rank (ddp_comm_init_self) the shard is the whole bucket; on a local group of 3
// threads the shards, the gather and the norm hold exact values.
#include <doctest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "ddp.h"

#define CHECK_STATUS(call, want, needle)                                                         \
  do {                                                                                           \
    ddp_status_t st_ = (call);                                                                   \
    CHECK_MESSAGE(st_ == (want), #call, " -> ", ddp_status_string(st_), ": ", ddp_last_error()); \
    CHECK_MESSAGE(std::strstr(ddp_last_error(), (needle)) != nullptr, ddp_last_error());         \
  } while (0)

namespace {

ddp_config_t sharded() {
  ddp_config_t c = DDP_CONFIG_INITIALIZER;
  c.layout = DDP_LAYOUT_ARENA;
  c.plan_order = DDP_PLAN_REGISTRATION;
  c.shard = 1;
  c.message_size = 100;
  return c;
}

struct Self {
  ddp_comm_t comm = nullptr;
  ddp_t ddp = nullptr;
  int a = -1, b = -1, c = -1;
  explicit Self(const ddp_config_t& cfg) {
    REQUIRE(ddp_comm_init_self(&comm) == DDP_SUCCESS);
    REQUIRE(ddp_create(comm, &cfg, &ddp) == DDP_SUCCESS);
    REQUIRE(ddp_register_grad(ddp, nullptr, 70, DDP_F32, 0, &a) == DDP_SUCCESS);
    REQUIRE(ddp_register_grad(ddp, nullptr, 50, DDP_F64, 0, &b) == DDP_SUCCESS);
    REQUIRE(ddp_register_grad(ddp, nullptr, 33, DDP_F16, 0, &c) == DDP_SUCCESS);
  }
  ~Self() {
    ddp_destroy(ddp);
    ddp_comm_destroy(comm);
  }
  void iterate() {
    REQUIRE(ddp_begin_backward(ddp, nullptr) == DDP_SUCCESS);
    for (int g : {c, b, a}) REQUIRE(ddp_grad_ready(ddp, g) == DDP_SUCCESS);
    REQUIRE(ddp_finish_backward(ddp, nullptr) == DDP_SUCCESS);
  }
};

}  // namespace

TEST_CASE("shard: combinations that cannot shard are refused at ddp_create, saying why") {
  ddp_comm_t comm;
  REQUIRE(ddp_comm_init_self(&comm) == DDP_SUCCESS);
  ddp_t d = nullptr;
  ddp_config_t c = sharded();
  c.layout = DDP_LAYOUT_COPY;
  CHECK_STATUS(ddp_create(comm, &c, &d), DDP_ERR_INVALID_ARGUMENT,
               "config.shard needs config.layout = DDP_LAYOUT_ARENA");
  c = sharded();
  c.plan_order = DDP_PLAN_LEARNED;
  CHECK_STATUS(ddp_create(comm, &c, &d), DDP_ERR_INVALID_ARGUMENT, "DDP_PLAN_REGISTRATION");
  CHECK(d == nullptr);
  // A config of version 2 (no shard field) is not sharded.
  c = sharded();
  c.size = offsetof(ddp_config_t, shard);
  REQUIRE(ddp_create(comm, &c, &d) == DDP_SUCCESS);
  CHECK_STATUS(ddp_gather_params(d, nullptr), DDP_ERR_INVALID_STATE, "needs a sharded context");
  ddp_destroy(d);
  ddp_comm_destroy(comm);
}

TEST_CASE("shard: every shard call on an unsharded context is refused") {
  ddp_comm_t comm;
  REQUIRE(ddp_comm_init_self(&comm) == DDP_SUCCESS);
  ddp_t d = nullptr;
  REQUIRE(ddp_create(comm, nullptr, &d) == DDP_SUCCESS);
  std::vector<float> g(10);
  int i = -1;
  REQUIRE(ddp_register_grad(d, g.data(), g.size(), DDP_F32, 0, &i) == DDP_SUCCESS);
  ddp_shard_info_t info;
  info.size = sizeof info;
  void* p = nullptr;
  double norm = 0;
  size_t first = 0;
  CHECK_STATUS(ddp_get_shard(d, 0, &info), DDP_ERR_INVALID_STATE, "ddp_get_shard: this call needs a sharded context");
  CHECK_STATUS(ddp_grad_shard(d, 0, &first, nullptr, nullptr), DDP_ERR_INVALID_STATE, "needs a sharded context");
  CHECK_STATUS(ddp_param_ptr(d, 0, &p), DDP_ERR_INVALID_STATE, "needs a sharded context");
  CHECK_STATUS(ddp_broadcast_params(d, 0, nullptr), DDP_ERR_INVALID_STATE, "needs a sharded context");
  CHECK_STATUS(ddp_gather_params(d, nullptr), DDP_ERR_INVALID_STATE, "needs a sharded context");
  CHECK_STATUS(ddp_wait_params(d, -1, nullptr), DDP_ERR_INVALID_STATE, "needs a sharded context");
  CHECK_STATUS(ddp_shard_norm(d, nullptr, &norm, nullptr), DDP_ERR_INVALID_STATE, "needs a sharded context");
  ddp_destroy(d);
  ddp_comm_destroy(comm);
}

TEST_CASE("shard: misuse of the shard calls answers a status and a message") {
  Self s(sharded());
  ddp_shard_info_t info;
  info.size = sizeof info;
  void* p = nullptr;
  double norm = 0;
  CHECK_STATUS(ddp_get_shard(nullptr, 0, &info), DDP_ERR_INVALID_ARGUMENT, "NULL");
  CHECK_STATUS(ddp_get_shard(s.ddp, 0, nullptr), DDP_ERR_INVALID_ARGUMENT, "info");
  info.size = 8;
  CHECK_STATUS(ddp_get_shard(s.ddp, 0, &info), DDP_ERR_INVALID_ARGUMENT, "set it to sizeof(ddp_shard_info_t)");
  info.size = sizeof info;
  CHECK_STATUS(ddp_get_shard(s.ddp, 99, &info), DDP_ERR_INVALID_ARGUMENT, "bucket 99 out of range");
  CHECK_STATUS(ddp_get_shard(s.ddp, -1, &info), DDP_ERR_INVALID_ARGUMENT, "bucket -1 out of range");
  CHECK_STATUS(ddp_grad_shard(s.ddp, 3, nullptr, nullptr, nullptr), DDP_ERR_INVALID_ARGUMENT,
               "grad index 3 out of range");
  CHECK_STATUS(ddp_param_ptr(s.ddp, 7, &p), DDP_ERR_INVALID_ARGUMENT, "grad index 7 out of range");
  CHECK_STATUS(ddp_param_ptr(s.ddp, 0, nullptr), DDP_ERR_INVALID_ARGUMENT, "param");
  CHECK_STATUS(ddp_wait_params(s.ddp, 5, nullptr), DDP_ERR_INVALID_ARGUMENT, "grad index 5 out of range");
  CHECK_STATUS(ddp_broadcast_params(s.ddp, 1, nullptr), DDP_ERR_INVALID_ARGUMENT, "root 1 out of range");
  CHECK_STATUS(ddp_shard_norm(s.ddp, nullptr, nullptr, nullptr), DDP_ERR_INVALID_ARGUMENT, "norm");
  // A wait before any gather; a gather inside a backward pass; a second gather; one after no_sync.
  CHECK_STATUS(ddp_wait_params(s.ddp, 0, nullptr), DDP_ERR_INVALID_STATE, "no parameter gather was launched");
  REQUIRE(ddp_begin_backward(s.ddp, nullptr) == DDP_SUCCESS);
  CHECK_STATUS(ddp_gather_params(s.ddp, nullptr), DDP_ERR_INVALID_STATE, "inside a backward pass");
  CHECK_STATUS(ddp_shard_norm(s.ddp, nullptr, &norm, nullptr), DDP_ERR_INVALID_STATE, "inside a backward pass");
  CHECK_STATUS(ddp_broadcast_params(s.ddp, 0, nullptr), DDP_ERR_INVALID_STATE, "inside a backward pass");
  REQUIRE(ddp_finish_backward(s.ddp, nullptr) == DDP_ERR_INVALID_STATE);  // unused grads, error policy
  REQUIRE(ddp_gather_params(s.ddp, nullptr) == DDP_SUCCESS);
  CHECK(ddp_wait_params(s.ddp, s.b, nullptr) == DDP_SUCCESS);
  CHECK_STATUS(ddp_gather_params(s.ddp, nullptr), DDP_ERR_INVALID_STATE, "already gathered since the last reduction");
  REQUIRE(ddp_set_sync(s.ddp, 0) == DDP_SUCCESS);
  s.iterate();
  CHECK(ddp_wait_params(s.ddp, -1, nullptr) == DDP_SUCCESS);  // the gather before accumulating still counts
  REQUIRE(ddp_set_sync(s.ddp, 1) == DDP_SUCCESS);
  s.iterate();
  REQUIRE(ddp_set_sync(s.ddp, 0) == DDP_SUCCESS);
  s.iterate();
  CHECK_STATUS(ddp_gather_params(s.ddp, nullptr), DDP_ERR_INVALID_STATE, "the shards are not final");
  REQUIRE(ddp_set_sync(s.ddp, 1) == DDP_SUCCESS);
  s.iterate();
  CHECK(ddp_gather_params(s.ddp, nullptr) == DDP_SUCCESS);
  CHECK(ddp_wait_params(s.ddp, -1, nullptr) == DDP_SUCCESS);
}

TEST_CASE("shard: on one rank the shard is the whole padded bucket, scaled, with zero padding") {
  ddp_config_t cfg = sharded();
  cfg.gradient_predivide_factor = 4.0;
  cfg.gradient_average = 0;
  Self s(cfg);
  int nb = 0;
  REQUIRE(ddp_get_plan(s.ddp, &nb, nullptr) == DDP_SUCCESS);
  REQUIRE(nb == 3);  // one bucket per dtype at message_size 100
  for (int b = 0; b < nb; ++b) {
    ddp_shard_info_t info;
    info.size = sizeof info;
    REQUIRE(ddp_get_shard(s.ddp, b, &info) == DDP_SUCCESS);
    CHECK(info.shard_offset == 0);
    CHECK(info.shard_numel == info.bucket_numel);
    CHECK(info.bucket_numel >= info.grads_numel);
    CHECK(info.shard_numel * (info.dtype == DDP_F64 ? 8 : info.dtype == DDP_F32 ? 4 : 2) % 256 == 0);
    CHECK(info.arena_offset % 256 == 0);
  }
  float* a = nullptr;
  REQUIRE(ddp_grad_ptr(s.ddp, s.a, reinterpret_cast<void**>(&a)) == DDP_SUCCESS);
  for (int i = 0; i < 70; ++i) a[i] = static_cast<float>(i);
  s.iterate();
  for (int i = 0; i < 70; ++i) CHECK(a[i] == static_cast<float>(i) / 4.0f);
  size_t first = 9, count = 9, pos = 9;
  REQUIRE(ddp_grad_shard(s.ddp, s.a, &first, &count, &pos) == DDP_SUCCESS);
  CHECK(first == 0);
  CHECK(count == 70);
  double norm = 0;
  uint64_t bad = 7;
  REQUIRE(ddp_shard_norm(s.ddp, nullptr, &norm, &bad) == DDP_SUCCESS);
  double want = 0;
  for (int i = 0; i < 70; ++i) want += (i / 4.0) * (i / 4.0);
  CHECK(norm == doctest::Approx(std::sqrt(want)).epsilon(1e-12));
  CHECK(bad == 0);
  a[3] = NAN;
  REQUIRE(ddp_shard_norm(s.ddp, nullptr, &norm, &bad) == DDP_SUCCESS);
  CHECK(bad == 1);
  // Parameters: written, gathered (a no-op on one rank), and where ddp_param_ptr says.
  float* pa = nullptr;
  REQUIRE(ddp_param_ptr(s.ddp, s.a, reinterpret_cast<void**>(&pa)) == DDP_SUCCESS);
  CHECK(pa != a);
  pa[69] = 2.5f;
  REQUIRE(ddp_broadcast_params(s.ddp, 0, nullptr) == DDP_SUCCESS);
  REQUIRE(ddp_gather_params(s.ddp, nullptr) == DDP_SUCCESS);
  REQUIRE(ddp_wait_params(s.ddp, s.a, nullptr) == DDP_SUCCESS);
  CHECK(pa[69] == 2.5f);
  ddp_stats_t st;
  st.size = sizeof st;
  REQUIRE(ddp_get_stats(s.ddp, &st) == DDP_SUCCESS);
  CHECK(st.library_bytes >= 2 * st.arena_bytes);  // the grad arena and the parameter arena
}

TEST_CASE("shard: 3 ranks of a local group reduce-scatter, gather and agree on the norm") {
  const int n = 3;
  ddp_local_group_t g;
  REQUIRE(ddp_local_group_create(n, &g) == DDP_SUCCESS);
  std::atomic<int> failed{0};
  std::vector<double> norms(n);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      ddp_comm_t comm;
      ddp_t d;
      ddp_config_t cfg = sharded();
      cfg.num_streams = 2;
      if (ddp_comm_init_local(g, r, &comm) || ddp_create(comm, &cfg, &d)) {
        ++failed;
        return;
      }
      const size_t sizes[3] = {301, 7, 1000};
      int idx[3];
      bool ok = true;
      for (int i = 0; i < 3; ++i)
        ok = ok && ddp_register_grad(d, nullptr, sizes[i], DDP_F64, 0, &idx[i]) == DDP_SUCCESS;
      for (int i = 0; i < 3 && ok; ++i) {
        double* p = nullptr;
        ok = ddp_grad_ptr(d, idx[i], reinterpret_cast<void**>(&p)) == DDP_SUCCESS;
        for (size_t k = 0; ok && k < sizes[i]; ++k) p[k] = (r + 1) * 1000.0 + i * 10.0 + static_cast<double>(k);
      }
      ok = ok && ddp_begin_backward(d, nullptr) == DDP_SUCCESS;
      for (int i = (r % 2 ? 0 : 2), k = 0; ok && k < 3; ++k, i = (i + (r % 2 ? 1 : 2)) % 3)
        ok = ddp_grad_ready(d, idx[i]) == DDP_SUCCESS;
      ok = ok && ddp_finish_backward(d, nullptr) == DDP_SUCCESS;
      for (int i = 0; i < 3 && ok; ++i) {  // the average over ranks: 2000 + 10 i + k
        double* p = nullptr;
        size_t first = 0, count = 0;
        ok = ddp_grad_ptr(d, idx[i], reinterpret_cast<void**>(&p)) == DDP_SUCCESS &&
             ddp_grad_shard(d, idx[i], &first, &count, nullptr) == DDP_SUCCESS;
        for (size_t k = first; ok && k < first + count; ++k) ok = p[k] == 2000.0 + i * 10.0 + static_cast<double>(k);
      }
      ok = ok && ddp_shard_norm(d, nullptr, &norms[static_cast<size_t>(r)], nullptr) == DDP_SUCCESS;
      int nb = 0;
      ok = ok && ddp_get_plan(d, &nb, nullptr) == DDP_SUCCESS;
      for (int b = 0; b < nb && ok; ++b) {
        ddp_shard_info_t s;
        s.size = sizeof s;
        ok = ddp_get_shard(d, b, &s) == DDP_SUCCESS;
        for (size_t k = 0; ok && k < s.shard_numel; ++k) static_cast<double*>(s.param_shard)[k] = r * 100000.0 + k;
      }
      ok = ok && ddp_gather_params(d, nullptr) == DDP_SUCCESS && ddp_wait_params(d, -1, nullptr) == DDP_SUCCESS;
      for (int b = 0; b < nb && ok; ++b) {  // every rank's shard arrived everywhere
        ddp_shard_info_t s;
        s.size = sizeof s;
        ok = ddp_get_shard(d, b, &s) == DDP_SUCCESS;
        const double* all = static_cast<double*>(s.param_shard) - s.shard_offset;
        for (size_t k = 0; ok && k < s.bucket_numel; ++k)
          ok = all[k] == static_cast<double>(k / s.shard_numel) * 100000.0 + static_cast<double>(k % s.shard_numel);
      }
      if (!ok) ++failed;
      ddp_destroy(d);
      ddp_comm_destroy(comm);
    });
  for (auto& t : ts) t.join();
  ddp_local_group_destroy(g);
  CHECK(failed == 0);
  CHECK(norms[0] == norms[1]);
  CHECK(norms[1] == norms[2]);
  double want = 0;
  for (int i = 0; i < 3; ++i)
    for (size_t k = 0; k < (i == 0 ? 301u : i == 1 ? 7u : 1000u); ++k) want += std::pow(2000.0 + i * 10.0 + k, 2);
  CHECK(norms[0] == doctest::Approx(std::sqrt(want)).epsilon(1e-12));
}

TEST_CASE("shard: an unsharded copy context still stages only its packed grads (no padded buckets)") {
  ddp_local_group_t g;
  REQUIRE(ddp_local_group_create(1, &g) == DDP_SUCCESS);
  ddp_comm_t comm;
  REQUIRE(ddp_comm_init_local(g, 0, &comm) == DDP_SUCCESS);
  ddp_t d;
  REQUIRE(ddp_create(comm, nullptr, &d) == DDP_SUCCESS);
  std::vector<float> big(2u << 20), small(100);  // big: reduced in place (at least one host piece)
  int i = -1;
  REQUIRE(ddp_register_grad(d, big.data(), big.size(), DDP_F32, 0, &i) == DDP_SUCCESS);
  REQUIRE(ddp_register_grad(d, small.data(), small.size(), DDP_F32, 0, &i) == DDP_SUCCESS);
  REQUIRE(ddp_reduce_all(d, nullptr) == DDP_SUCCESS);
  ddp_stats_t st;
  st.size = sizeof st;
  REQUIRE(ddp_get_stats(d, &st) == DDP_SUCCESS);
  CHECK(st.library_bytes < 64 * 1024);  // the small grad's staging, not the whole bucket's 8 MB
  CHECK(st.bytes_reduced == (big.size() + small.size()) * sizeof(float));
  ddp_destroy(d);
  ddp_comm_destroy(comm);
  ddp_local_group_destroy(g);
}

// 40 buckets on one stream with the parameter gather of every bucket still queued (a peer is late to
// it) when the next backward pass marks every grad: the stream holds 40 gathers and 40 reductions at
// once. It once had room for 41 tasks: ddp_grad_ready answered DDP_ERR_INTERNAL "task ring full".
TEST_CASE("shard: marking every grad of 40 buckets while their gathers are queued on the one stream") {
  const size_t n = 64, grads = 40;
  ddp_local_group_t g;
  REQUIRE(ddp_local_group_create(2, &g) == DDP_SUCCESS);
  std::atomic<int> failed{0};
  std::vector<std::string> errors(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      ddp_comm_t comm;
      ddp_t d;
      ddp_config_t cfg = sharded();
      cfg.num_streams = 1;
      cfg.message_size = 1;  // a bucket per grad
      cfg.timeout_ms = 20000;
      if (ddp_comm_init_local(g, r, &comm) || ddp_create(comm, &cfg, &d)) {
        ++failed;
        return;
      }
      int idx = -1, nb = 0;
      bool ok = true;
      for (size_t i = 0; i < grads && ok; ++i) ok = ddp_register_grad(d, nullptr, n, DDP_F32, 0, &idx) == DDP_SUCCESS;
      ok = ok && ddp_get_plan(d, &nb, nullptr) == DDP_SUCCESS && nb == static_cast<int>(grads);
      if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));  // rank 0's gathers wait in line
      ok = ok && ddp_gather_params(d, nullptr) == DDP_SUCCESS && ddp_begin_backward(d, nullptr) == DDP_SUCCESS;
      for (int i = 0; i < static_cast<int>(grads) && ok; ++i) {
        float* p = nullptr;
        ok = ddp_grad_ptr(d, i, reinterpret_cast<void**>(&p)) == DDP_SUCCESS;
        for (size_t k = 0; ok && k < n; ++k) p[k] = static_cast<float>(r + 1);
        ok = ok && ddp_grad_ready(d, i) == DDP_SUCCESS;
      }
      ok = ok && ddp_finish_backward(d, nullptr) == DDP_SUCCESS;
      for (int i = 0; i < static_cast<int>(grads) && ok; ++i) {  // this rank's shard holds the average
        float* p = nullptr;
        size_t first = 0, count = 0;
        ok = ddp_grad_ptr(d, i, reinterpret_cast<void**>(&p)) == DDP_SUCCESS &&
             ddp_grad_shard(d, i, &first, &count, nullptr) == DDP_SUCCESS;
        for (size_t k = first; ok && k < first + count; ++k) ok = p[k] == 1.5f;
      }
      if (!ok) {
        errors[static_cast<size_t>(r)] = ddp_last_error();
        ++failed;
      }
      ddp_destroy(d);
      ddp_comm_destroy(comm);
    });
  for (auto& t : ts) t.join();
  ddp_local_group_destroy(g);
  CAPTURE(errors[0]);
  CAPTURE(errors[1]);
  CHECK(failed == 0);
}
