// Ranks that disagree on a collective, as a user's program can make them: different counts, types or
// roots in ddp_broadcast and ddp_comm_allreduce (inside a comm hook too), different calls at the same
// point, stream communicators in different orders. Every rank gets DDP_ERR_MISMATCH naming both sides,
// and nothing reads past a buffer (the ASan build runs these too). Also the arguments refused on the
// rank that makes them (misaligned buffers, sizes past the address space, a hook's bucket->comm
// destroyed, a hook status outside the enum) and the exact integer average of ddp_allreduce_host.
#include <doctest.h>

#include <cstdint>
#include <cstring>
#include <thread>
#include <mutex>
#include <string>
#include <vector>

#include "ddp.h"
#include "local_ranks.hpp"

namespace {

bool has(const std::string& s, const char* needle) { return s.find(needle) != std::string::npos; }

// What each of `n` ranks got from fn(rank, comm, ddp) on a context of its own (timeout 20 s).
struct Got {
  ddp_status_t status = DDP_SUCCESS;
  std::string message;
};
template <class F>
std::vector<Got> on_contexts(int n, F fn, const ddp_config_t* config = nullptr) {
  std::vector<Got> got(static_cast<size_t>(n));
  on_ranks(n, [&](int rank, ddp_comm_t comm) {
    ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
    if (config) cfg = *config;
    cfg.timeout_ms = 20000;
    ddp_t d = nullptr;
    Got& g = got[static_cast<size_t>(rank)];
    g.status = ddp_create(comm, &cfg, &d);
    if (g.status == DDP_SUCCESS) g.status = fn(rank, comm, d);
    if (g.status != DDP_SUCCESS) g.message = ddp_last_error();
    ddp_destroy(d);
    return true;
  });
  return got;
}

void check_all(const std::vector<Got>& got, ddp_status_t want, const std::vector<const char*>& needles) {
  for (size_t r = 0; r < got.size(); ++r) {
    CAPTURE(r);
    CAPTURE(got[r].message);
    CHECK(got[r].status == want);
    for (const char* n : needles) CHECK(has(got[r].message, n));
  }
}

}  // namespace

TEST_CASE("ddp_broadcast: counts, dtypes, n or roots that differ fail every rank, naming the difference") {
  struct Case {
    const char* name;
    std::vector<const char*> needles;
  };
  const Case cases[] = {
      {"root's count larger", {"buffer 1 is 64 elements of f32 on rank 0 but 4 elements of f32 on rank 1"}},
      {"receiver's count larger", {"buffer 1 is 4 elements of f32 on rank 0 but 64 elements of f32 on rank 1"}},
      {"dtypes differ", {"buffer 1 is 4 elements of f64 on rank 0 but 4 elements of f32 on rank 1"}},
      {"n differs", {"ddp_broadcast(2 buffers from root 0)", "ddp_broadcast(1 buffer from root 0)"}},
      {"each rank its own root", {"ddp_broadcast(2 buffers from root 0)", "ddp_broadcast(2 buffers from root 1)"}},
  };
  for (int c = 0; c < 5; ++c) {
    CAPTURE(cases[c].name);
    std::vector<std::vector<double>> seen(2);
    const std::vector<Got> got = on_contexts(2, [&](int rank, ddp_comm_t, ddp_t d) {
      std::vector<double> first(3, rank + 1.0), second(64, rank + 1.0);
      void* bufs[2] = {first.data(), second.data()};
      size_t counts[2] = {3, 4};
      ddp_dtype_t dtypes[2] = {DDP_F64, DDP_F32};
      int n = 2, root = 0;
      if (c == 0 && rank == 0) counts[1] = 64;
      if (c == 1 && rank == 1) counts[1] = 64;
      if (c == 2 && rank == 0) dtypes[1] = DDP_F64;
      if (c == 3 && rank == 1) n = 1;
      if (c == 4) root = rank;
      const ddp_status_t st = ddp_broadcast(d, bufs, counts, dtypes, n, root, nullptr);
      seen[static_cast<size_t>(rank)] = first;
      return st;
    });
    check_all(got, DDP_ERR_MISMATCH, cases[c].needles);
    CHECK(seen[1] == std::vector<double>(3, 2.0));  // nothing was sent, not even the buffers that agree
  }
  // Agreeing ranks still broadcast.
  const std::vector<Got> ok = on_contexts(3, [](int rank, ddp_comm_t, ddp_t d) {
    std::vector<float> b(5, static_cast<float>(rank));
    void* bufs[1] = {b.data()};
    const size_t counts[1] = {b.size()};
    const ddp_dtype_t dtypes[1] = {DDP_F32};
    const ddp_status_t st = ddp_broadcast(d, bufs, counts, dtypes, 1, 2, nullptr);
    return st == DDP_SUCCESS && b == std::vector<float>(5, 2.0f) ? st : DDP_ERR_INTERNAL;
  });
  check_all(ok, DDP_SUCCESS, {});
}

// A step count, an RNG state or token counts travel as integers, beside float state.
TEST_CASE("ddp_broadcast: integer buffers (i32, i64) travel beside float ones; an i32/i64 difference is named") {
  const std::vector<Got> ok = on_contexts(3, [](int rank, ddp_comm_t, ddp_t d) {
    int64_t step = rank == 1 ? 123456789012345 : -1;
    std::vector<int32_t> ids(7, rank == 1 ? -77 : rank);
    std::vector<double> w(5, rank);
    void* bufs[3] = {&step, ids.data(), w.data()};
    const size_t counts[3] = {1, ids.size(), w.size()};
    const ddp_dtype_t dtypes[3] = {DDP_I64, DDP_I32, DDP_F64};
    const ddp_status_t st = ddp_broadcast(d, bufs, counts, dtypes, 3, 1, nullptr);
    const bool same =
        step == 123456789012345 && ids == std::vector<int32_t>(7, -77) && w == std::vector<double>(5, 1.0);
    return st == DDP_SUCCESS && same ? st : DDP_ERR_INTERNAL;
  });
  check_all(ok, DDP_SUCCESS, {});
  const std::vector<Got> bad = on_contexts(2, [](int rank, ddp_comm_t, ddp_t d) {
    int64_t step = 5;
    void* bufs[1] = {&step};
    const size_t counts[1] = {1};
    const ddp_dtype_t dtypes[1] = {rank == 0 ? DDP_I64 : DDP_I32};
    return ddp_broadcast(d, bufs, counts, dtypes, 1, 0, nullptr);
  });
  check_all(bad, DDP_ERR_MISMATCH, {"buffer 0 is 1 elements of i64 on rank 0 but 1 elements of i32 on rank 1"});
  const std::vector<Got> invalid = on_contexts(1, [](int, ddp_comm_t, ddp_t d) {
    int64_t step = 5;
    void* bufs[1] = {&step};
    const size_t counts[1] = {1};
    const ddp_dtype_t dtypes[1] = {static_cast<ddp_dtype_t>(9)};
    return ddp_broadcast(d, bufs, counts, dtypes, 1, 0, nullptr);
  });
  check_all(invalid, DDP_ERR_INVALID_ARGUMENT, {"dtypes[0] is 9, not a ddp_dtype_t"});
}

TEST_CASE("ddp_comm_allreduce: counts or dtypes that differ between ranks fail every rank, naming both") {
  for (int c = 0; c < 3; ++c) {
    std::vector<Got> got(3);
    on_ranks(3, [&](int rank, ddp_comm_t comm) {
      std::vector<double> b(rank == 2 && c == 0 ? 1000 : 10, 1.0);
      const ddp_dtype_t dt = rank == 2 && c == 1 ? DDP_F32 : DDP_F64;
      got[static_cast<size_t>(rank)].status = ddp_comm_allreduce(comm, b.data(), 10, dt, DDP_OP_SUM, nullptr);
      if (c == 0)
        got[static_cast<size_t>(rank)].status =
            ddp_comm_allreduce(comm, b.data(), b.size(), DDP_F64, DDP_OP_SUM, nullptr);
      if (c == 2)  // a rank with nothing to reduce still meets the others (it used to return at once)
        got[static_cast<size_t>(rank)].status =
            ddp_comm_allreduce(comm, b.data(), rank == 2 ? 0 : 5, DDP_F64, DDP_OP_SUM, nullptr);
      got[static_cast<size_t>(rank)].message = ddp_last_error();
      return true;
    });
    for (int r = 0; r < 3; ++r) {
      CAPTURE(got[static_cast<size_t>(r)].message);
      CHECK(got[static_cast<size_t>(r)].status == DDP_ERR_MISMATCH);
      CHECK(has(got[static_cast<size_t>(r)].message, "the ranks called different collectives on one communicator"));
      CHECK(has(got[static_cast<size_t>(r)].message, c == 0   ? "1000 elements of f64"
                                                     : c == 1 ? "10 elements of f32"
                                                              : "an allreduce of 0 elements"));
    }
  }
}

// Nothing to reduce on every rank is a collective like any other: each rank meets the others and
// returns success, with a NULL buffer or not (under UBSan this once passed a NULL pointer to memcpy).
TEST_CASE("ddp_comm_allreduce: 0 elements on every rank, NULL buffers or not, every dtype and op: success") {
  const ddp_dtype_t dtypes[] = {DDP_F16, DDP_BF16, DDP_F32, DDP_F64};
  for (int world = 1; world <= 3; ++world)
    for (ddp_dtype_t dt : dtypes)
      for (ddp_op_t op : {DDP_OP_SUM, DDP_OP_AVG}) {
        std::vector<Got> got(static_cast<size_t>(world));
        on_ranks(world, [&](int rank, ddp_comm_t comm) {
          double spare = 7.0;
          void* buf = rank % 2 ? nullptr : &spare;
          got[static_cast<size_t>(rank)].status = ddp_comm_allreduce(comm, buf, 0, dt, op, nullptr);
          got[static_cast<size_t>(rank)].message = ddp_last_error();
          return spare == 7.0;
        });
        for (const Got& g : got) {
          CAPTURE(g.message);
          CHECK(g.status == DDP_SUCCESS);
        }
      }
}

namespace {

// Rank 1's hook reduces half the bucket, or its elements as another type.
extern "C" ddp_status_t uneven_hook(const ddp_hook_bucket_t* b, void* how) {
  const int c = *static_cast<const int*>(how);
  size_t count = b->count;
  ddp_dtype_t dt = b->dtype;
  if (b->rank == 1 && c == 0) count /= 2;
  if (b->rank == 1 && c == 1) dt = DDP_F16;
  return ddp_comm_allreduce(b->comm, b->buffer, count, dt, DDP_OP_SUM, b->stream);
}

extern "C" ddp_status_t destroying_hook(const ddp_hook_bucket_t* b, void* status) {
  *static_cast<ddp_status_t*>(status) = ddp_comm_destroy(b->comm);
  return ddp_comm_allreduce(b->comm, b->buffer, b->count, b->dtype, DDP_OP_SUM, b->stream);
}

// Returns what C code often returns for a failure: -1, outside the enum.
extern "C" ddp_status_t minus_one_hook(const ddp_hook_bucket_t*, void*) {
  const int failure = -1;
  ddp_status_t st;
  std::memcpy(&st, &failure, sizeof st);
  return st;
}

// One iteration of a grad of 128 floats through `hook`.
ddp_status_t hooked(ddp_t d, ddp_comm_hook_fn hook, void* arg) {
  std::vector<float> g(128, 1.0f);
  int idx = -1;
  ddp_status_t st = ddp_set_comm_hook(d, hook, arg);
  if (st == DDP_SUCCESS) st = ddp_register_grad(d, g.data(), g.size(), DDP_F32, 0, &idx);
  if (st == DDP_SUCCESS) st = ddp_begin_backward(d, nullptr);
  if (st == DDP_SUCCESS) st = ddp_grad_ready(d, idx);
  if (st == DDP_SUCCESS) st = ddp_finish_backward(d, nullptr);
  return st;
}

}  // namespace

TEST_CASE("comm hook: a hook whose ranks reduce different counts or types fails every rank") {
  for (int c = 0; c < 2; ++c) {
    int how = c;
    const std::vector<Got> got = on_contexts(2, [&](int, ddp_comm_t, ddp_t d) { return hooked(d, uneven_hook, &how); });
    check_all(got, DDP_ERR_ABORTED, {"comm hook returned 3", "the ranks called different collectives"});
  }
}

TEST_CASE("comm hook: bucket->comm cannot be destroyed; a status outside the enum is a failure") {
  std::vector<ddp_status_t> destroy(2, DDP_SUCCESS);
  const std::vector<Got> kept = on_contexts(2, [&](int rank, ddp_comm_t, ddp_t d) {
    return hooked(d, destroying_hook, &destroy[static_cast<size_t>(rank)]);
  });
  check_all(kept, DDP_SUCCESS, {});
  for (ddp_status_t st : destroy) CHECK(st == DDP_ERR_INVALID_ARGUMENT);
  const std::vector<Got> failed =
      on_contexts(2, [](int, ddp_comm_t, ddp_t d) { return hooked(d, minus_one_hook, nullptr); });
  check_all(failed, DDP_ERR_ABORTED, {"comm hook returned -1 (unknown status)"});
}

TEST_CASE("control path: a barrier against another rank's registration check names both calls") {
  const std::vector<Got> got = on_contexts(2, [](int rank, ddp_comm_t, ddp_t d) {
    std::vector<float> g(16);
    int idx = -1;
    ddp_status_t st = ddp_register_grad(d, g.data(), g.size(), DDP_F32, 0, &idx);
    if (st != DDP_SUCCESS) return st;
    return rank == 0 ? ddp_begin_backward(d, nullptr) : ddp_barrier(d);
  });
  check_all(got, DDP_ERR_MISMATCH, {"the ranks called different collectives", "ddp_barrier", "the registration check"});
}

TEST_CASE("config.stream_comms in different orders are refused at ddp_create, naming the first that differs") {
  std::vector<Got> got(2);
  ddp_local_group_t group = nullptr;
  REQUIRE(ddp_local_group_create(2, &group) == DDP_SUCCESS);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank)
    ranks.emplace_back([&, rank] {
      // A rank's communicators match the other's made in the same order: comm, a, b.
      ddp_comm_t comm = nullptr, a = nullptr, b = nullptr;
      ddp_comm_init_local(group, rank, &comm);
      ddp_comm_init_local(group, rank, &a);
      ddp_comm_init_local(group, rank, &b);
      const ddp_comm_t order[2] = {rank == 0 ? a : b, rank == 0 ? b : a};
      ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
      cfg.num_streams = 2;
      cfg.stream_comms = order;
      cfg.timeout_ms = 20000;
      ddp_t d = nullptr;
      Got& g = got[static_cast<size_t>(rank)];
      g.status = ddp_create(comm, &cfg, &d);
      g.message = ddp_last_error();
      ddp_destroy(d);
      ddp_comm_destroy(a);
      ddp_comm_destroy(b);
      ddp_comm_destroy(comm);
    });
  for (std::thread& t : ranks) t.join();
  ddp_local_group_destroy(group);
  check_all(got, DDP_ERR_MISMATCH, {"config.stream_comms differ between ranks", "is stream_comms[1] of rank"});
}

TEST_CASE("ddp_allreduce_host and ddp_comm_allreduce refuse misaligned buffers and impossible sizes") {
  const std::vector<Got> got = on_contexts(2, [](int, ddp_comm_t comm, ddp_t d) {
    alignas(8) unsigned char raw[64] = {};
    void* odd = raw + 1;
    const ddp_status_t a = ddp_allreduce_host(d, odd, 4, DDP_F32, DDP_OP_SUM);
    const std::string ma = ddp_last_error();
    const ddp_status_t b = ddp_comm_allreduce(comm, odd, 4, DDP_F32, DDP_OP_SUM, nullptr);
    const std::string mb = ddp_last_error();
    const ddp_status_t c = ddp_comm_allreduce(comm, raw, SIZE_MAX / 2, DDP_F64, DDP_OP_SUM, nullptr);
    const std::string mc = ddp_last_error();
    const bool ok = a == DDP_ERR_INVALID_ARGUMENT && has(ma, "not aligned to its dtype: f32 needs 4-byte") &&
                    b == DDP_ERR_INVALID_ARGUMENT && has(mb, "not aligned to its dtype") &&
                    c == DDP_ERR_INVALID_ARGUMENT && has(mc, "more bytes than an address space holds");
    if (!ok) MESSAGE(ma, " | ", mb, " | ", mc);
    // Refused on the calling rank before any exchange: the context is intact.
    return ok ? ddp_barrier(d) : DDP_ERR_INTERNAL;
  });
  check_all(got, DDP_SUCCESS, {});
}

TEST_CASE("ddp_allreduce_host: integer averages are exact at the type's limits; integer sums wrap") {
  const std::vector<Got> got = on_contexts(2, [](int rank, ddp_comm_t, ddp_t d) {
    int64_t big[4] = {INT64_MAX, INT64_MIN, INT64_MAX, rank == 0 ? -7 : 2};
    int64_t sum[2] = {INT64_MAX, INT64_MIN};
    int32_t small[2] = {INT32_MAX, INT32_MIN};
    ddp_status_t st = ddp_allreduce_host(d, big, 4, DDP_I64, DDP_OP_AVG);
    if (st == DDP_SUCCESS) st = ddp_allreduce_host(d, sum, 2, DDP_I64, DDP_OP_SUM);
    if (st == DDP_SUCCESS) st = ddp_allreduce_host(d, small, 2, DDP_I32, DDP_OP_SUM);
    if (st != DDP_SUCCESS) return st;
    const bool ok = big[0] == INT64_MAX && big[1] == INT64_MIN && big[2] == INT64_MAX && big[3] == -2 &&  // -5/2
                    sum[0] == -2 && sum[1] == 0 && small[0] == -2 && small[1] == 0;
    return ok ? DDP_SUCCESS : DDP_ERR_INTERNAL;
  });
  check_all(got, DDP_SUCCESS, {});
}

TEST_CASE("gradient_predivide_factor: values whose reciprocal overflows a float are refused") {
  ddp_comm_t self = nullptr;
  REQUIRE(ddp_comm_init_self(&self) == DDP_SUCCESS);
  for (double f : {1e39, 1e-39, 1e308, 4.9e-324}) {
    CAPTURE(f);
    ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
    cfg.gradient_predivide_factor = f;
    ddp_t d = nullptr;
    CHECK(ddp_create(self, &cfg, &d) == DDP_ERR_INVALID_ARGUMENT);
    CHECK(has(ddp_last_error(), "config.gradient_predivide_factor"));
    CHECK(has(ddp_last_error(), "2^-126 .. 2^126"));
  }
  for (double f : {0x1p-126, 0x1p126, 8.0, 0.125}) {
    ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
    cfg.gradient_predivide_factor = f;
    ddp_t d = nullptr;
    CHECK(ddp_create(self, &cfg, &d) == DDP_SUCCESS);
    ddp_destroy(d);
  }
  ddp_comm_destroy(self);
}

TEST_CASE("ddp_wait_grad: *reduced is left alone when the call fails") {
  ddp_comm_t self = nullptr;
  REQUIRE(ddp_comm_init_self(&self) == DDP_SUCCESS);
  ddp_t d = nullptr;
  REQUIRE(ddp_create(self, nullptr, &d) == DDP_SUCCESS);
  float g[4] = {};
  int idx = -1;
  REQUIRE(ddp_register_grad(d, g, 4, DDP_F32, 0, &idx) == DDP_SUCCESS);
  int reduced = 42;
  CHECK(ddp_wait_grad(d, 0, nullptr, &reduced) == DDP_ERR_INVALID_STATE);
  CHECK(reduced == 42);
  ddp_destroy(d);
  ddp_comm_destroy(self);
}
