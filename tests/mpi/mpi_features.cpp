// Multi-rank tests of what a trainer asks for beyond the backward pass, under mpirun (or over Gloo
// with DDP_TEST_GLOO): uneven inputs (ddp_join, random batch counts per rank, both divisors), the
// 16-bit wire (config.compression), host collectives (ddp_allreduce_host, ddp_barrier) and comm
// hooks (ddp_set_comm_hook with ddp_comm_allreduce). Values are checked against a float64 reference
// built from every rank's deterministic inputs; reduced values are bitwise the same on every rank.
// Built with DDP_TEST_NCCL=1 (the gpusim suite), the same cases run over ddp_comm_init_nccl_mpi with
// every grad in device memory: NCCL sums 16-bit grads in their own type, hooks enqueue on the
// bucket's stream, and ddp_comm_allreduce outside a hook is refused on a device comm.
// Rank 0 prints "mpi-features(np=N): P passed, F failed" (gloo-features over Gloo, mpi-nccl-features
// over NCCL).
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ddp.h"
#include "../support/mpi_harness.hpp"
#include "../support/int8_bound.hpp"
#include "../support/int8_model.hpp"
#include "../support/reference.hpp"

namespace {

// Grad memory of the copy layout (device memory on NCCL), freed with its owner.
using GradBuf = std::unique_ptr<void, void (*)(void*)>;
GradBuf grad_buf(size_t bytes) { return GradBuf(grad_alloc(bytes), grad_free); }

// Whether `got` is the reduced value (ref::close); NCCL sums 16-bit grads in their own type.
bool close_reduced(double got, double want, double mag, ddp_dtype_t d) {
  const bool native16 = DDP_TEST_NCCL && (d == DDP_F16 || d == DDP_BF16);
  return native16 ? ref::close_native16(got, want, mag, d) : ref::close(got, want, mag, d);
}

// Every rank's hash of `bytes` equal to rank 0's.
bool same_everywhere(const std::vector<char>& bytes, std::string* why, const char* what) {
  uint64_t h = 1469598103934665603ull;
  for (char c : bytes) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  std::vector<uint64_t> all(static_cast<size_t>(g_world));
  MPI_Allgather(&h, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
  for (int r = 0; r < g_world; ++r)
    if (all[static_cast<size_t>(r)] != all[0]) {
      *why = std::string(what) + ": rank " + std::to_string(r) + " holds other bits than rank 0";
      return false;
    }
  return true;
}

// --- host collectives ----------------------------------------------------------------------------

size_t host_size(ddp_dtype_t d) { return d == DDP_I32 ? 4 : d == DDP_I64 ? 8 : ref::dsize(d); }

// Small integers: every sum, max and min is exact in every type, whatever the order.
double small_value(uint64_t seed, int rank, size_t i) {
  return std::floor(ref::raw_value(seed, rank, 0, 0, i) * 4.0);  // -8..7
}

void store_host(void* p, size_t i, ddp_dtype_t d, double v) {
  if (d == DDP_I32) {
    const int32_t x = static_cast<int32_t>(v);
    std::memcpy(static_cast<char*>(p) + 4 * i, &x, 4);
  } else if (d == DDP_I64) {
    const int64_t x = static_cast<int64_t>(v);
    std::memcpy(static_cast<char*>(p) + 8 * i, &x, 8);
  } else {
    ref::store(p, i, d, v);
  }
}

double load_host(const void* p, size_t i, ddp_dtype_t d) {
  if (d == DDP_I32) {
    int32_t x;
    std::memcpy(&x, static_cast<const char*>(p) + 4 * i, 4);
    return x;
  }
  if (d == DDP_I64) {
    int64_t x;
    std::memcpy(&x, static_cast<const char*>(p) + 8 * i, 8);
    return static_cast<double>(x);
  }
  return ref::load(p, i, d);
}

// What ddp_allreduce_host must give for element i.
double host_expected(uint64_t seed, size_t i, ddp_dtype_t d, ddp_op_t op) {
  double acc = small_value(seed, 0, i);
  for (int r = 1; r < g_world; ++r) {
    const double v = small_value(seed, r, i);
    acc = op == DDP_OP_MAX ? std::max(acc, v) : op == DDP_OP_MIN ? std::min(acc, v) : acc + v;
  }
  if (op != DDP_OP_AVG) return acc;
  if (d == DDP_I32 || d == DDP_I64) return std::trunc(acc / g_world);
  if (d == DDP_F64) return acc / g_world;
  return ref::quantize(static_cast<double>(static_cast<float>(acc) / static_cast<float>(g_world)), d);
}

bool host_allreduce_case(ddp_t d, uint64_t seed, size_t count, ddp_dtype_t dt, ddp_op_t op, std::string* why) {
  std::vector<char> buf(count * host_size(dt) + 1);
  for (size_t i = 0; i < count; ++i) store_host(buf.data(), i, dt, small_value(seed, g_rank, i));
  EXPECT_OK(ddp_allreduce_host(d, buf.data(), count, dt, op));
  for (size_t i = 0; i < count; ++i) {
    const double got = load_host(buf.data(), i, dt), want = host_expected(seed, i, dt, op);
    if (got != want) {
      *why = "element " + std::to_string(i) + ": " + std::to_string(got) + ", want " + std::to_string(want);
      return false;
    }
  }
  return same_everywhere(buf, why, "ddp_allreduce_host");
}

void test_host_collectives(uint64_t seed) {
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.timeout_ms = 30000;
  ddp_t d = nullptr;
  std::string why;
  bool ok = ddp_create(g_comm, &cfg, &d) == DDP_SUCCESS;
  record("host: ddp_create", ok, ddp_last_error());
  if (!ok) return;
  const Closer closer{d};
  std::mt19937_64 shared(seed);
  const ddp_dtype_t types[] = {DDP_F16, DDP_BF16, DDP_F32, DDP_F64, DDP_I32, DDP_I64};
  const ddp_op_t ops[] = {DDP_OP_SUM, DDP_OP_AVG, DDP_OP_MAX, DDP_OP_MIN};
  int n = 0;
  for (ddp_dtype_t dt : types)
    for (ddp_op_t op : ops) {
      const size_t count = shared() % 3 == 0 ? 0 : 1 + shared() % 300;
      why.clear();
      ok = host_allreduce_case(d, seed + static_cast<uint64_t>(++n), count, dt, op, &why);
      record("host: ddp_allreduce_host " + std::to_string(count) + " x dtype " + std::to_string(dt) + " op " +
                 std::to_string(op),
             ok, why);
    }
  // Before registration closes and after: the control path does not depend on the buckets.
  const GradBuf one = grad_buf(sizeof(float));
  int index = -1;
  why.clear();
  ok = ddp_register_grad(d, one.get(), 1, DDP_F32, 0, &index) == DDP_SUCCESS && ddp_commit(d) == DDP_SUCCESS &&
       host_allreduce_case(d, seed + 99, 5, DDP_F64, DDP_OP_SUM, &why);
  record("host: ddp_allreduce_host after ddp_commit", ok, why.empty() ? ddp_last_error() : why);

  // Bad arguments: refused on the rank that made them, before any exchange.
  why.clear();
  double x = 0;
  ok = expect_status(ddp_allreduce_host(d, &x, 1, static_cast<ddp_dtype_t>(7), DDP_OP_SUM), DDP_ERR_INVALID_ARGUMENT,
                     "dtype 7 is not a ddp_dtype_t", &why) &&
       expect_status(ddp_allreduce_host(d, &x, 1, DDP_F64, static_cast<ddp_op_t>(9)), DDP_ERR_INVALID_ARGUMENT,
                     "op 9 is not a ddp_op_t", &why) &&
       expect_status(ddp_allreduce_host(d, nullptr, 3, DDP_F64, DDP_OP_SUM), DDP_ERR_INVALID_ARGUMENT,
                     "buf is NULL for 3 elements", &why) &&
       expect_status(ddp_allreduce_host(nullptr, &x, 1, DDP_F64, DDP_OP_SUM), DDP_ERR_INVALID_ARGUMENT, nullptr, &why);
  record("host: bad arguments refused", ok, why);

  // Inside a backward pass: refused.
  why.clear();
  ok = ddp_begin_backward(d, nullptr) == DDP_SUCCESS &&
       expect_status(ddp_allreduce_host(d, &x, 1, DDP_F64, DDP_OP_SUM), DDP_ERR_INVALID_STATE,
                     "not allowed inside a backward pass", &why) &&
       expect_status(ddp_barrier(d), DDP_ERR_INVALID_STATE, "not allowed inside a backward pass", &why) &&
       ddp_grad_ready(d, 0) == DDP_SUCCESS && ddp_finish_backward(d, nullptr) == DDP_SUCCESS;
  record("host: refused inside a backward pass", ok, why.empty() ? ddp_last_error() : why);

  // The barrier waits for the last rank: rank 0 arrives 300 ms late.
  const auto t0 = std::chrono::steady_clock::now();
  MPI_Barrier(MPI_COMM_WORLD);
  if (g_rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const ddp_status_t st = ddp_barrier(d);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  record("host: ddp_barrier waits for the last rank", st == DDP_SUCCESS && ms >= 250.0,
         "status " + std::string(ddp_status_string(st)) + ", " + std::to_string(ms) + " ms");
}

// A fresh context over g_comm (30 s timeout) for one disagreement, or nullptr (recorded as `what`).
ddp_t mismatch_context(const char* what) {
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.timeout_ms = 30000;
  ddp_t d = nullptr;
  if (ddp_create(g_comm, &cfg, &d) != DDP_SUCCESS) record(what, false, ddp_last_error());
  return d;
}

// Ranks that call different things fail together: sizes that differ, and a barrier against an
// allreduce. (Last: the context is aborted afterwards.)
void test_host_mismatch() {
  if (g_world < 2) return;
  for (int kind = 0; kind < 2; ++kind) {
    std::string why;
    ddp_t d = mismatch_context("host mismatch: ddp_create");
    if (!d) continue;
    const Closer closer{d};
    double buf[4] = {1, 2, 3, 4};
    const bool last = g_rank == g_world - 1;
    ddp_status_t st;
    if (kind == 0)
      st = ddp_allreduce_host(d, buf, last ? 4 : 3, DDP_F64, DDP_OP_SUM);
    else
      st = last ? ddp_barrier(d) : ddp_allreduce_host(d, buf, 3, DDP_F64, DDP_OP_SUM);
    const char* needle = kind == 0 ? "elements of f64" : "ddp_barrier";
    const bool ok = expect_status(st, DDP_ERR_MISMATCH, "the ranks called different collectives", &why) &&
                    std::strstr(ddp_last_error(), needle) != nullptr;
    if (ok) why.clear();
    record(std::string("host mismatch: ") + (kind == 0 ? "counts differ" : "a barrier against an allreduce"), ok,
           why.empty() ? (ok ? "" : ddp_last_error()) : why);
  }
}

// ddp_broadcast and ddp_comm_allreduce with arguments that differ between ranks: DDP_ERR_MISMATCH on
// every rank, where MPI would truncate the message and end the job (Open MPI reports a nonblocking
// collective's error through MPI_COMM_WORLD's handler, fatal by default) and Gloo would abort.
void test_argument_mismatch() {
  if (g_world < 2) return;
  const bool last = g_rank == g_world - 1;
  // Broadcasts are compared before any data moves (NCCL too); allreduces outside a hook on host comms.
  for (int kind = 0; kind < (DDP_TEST_NCCL ? 2 : 3); ++kind) {
    std::string why;
    ddp_t d = mismatch_context("argument mismatch: ddp_create");
    if (!d) continue;
    const Closer closer{d};
    std::vector<double> b(last ? 64 : 4, g_rank + 1.0);
    void* bufs[1] = {b.data()};
    size_t counts[1] = {b.size()};
    ddp_dtype_t dtypes[1] = {kind == 1 && last ? DDP_F32 : DDP_F64};
    if (kind == 1) counts[0] = 4;
    ddp_status_t st;
    const char* needle;
    if (kind < 2) {
      st = ddp_broadcast(d, bufs, counts, dtypes, 1, 0, nullptr);
      needle = kind == 0 ? "but 64 elements of f64 on rank" : "but 4 elements of f32 on rank";
    } else {
      st = ddp_comm_allreduce(g_comm, b.data(), b.size(), DDP_F64, DDP_OP_SUM, nullptr);
      needle = "the ranks passed different arguments";
    }
    const bool ok = expect_status(st, DDP_ERR_MISMATCH, needle, &why) && b[0] == g_rank + 1.0;
    static const char* names[3] = {"broadcast counts differ", "broadcast dtypes differ",
                                   "ddp_comm_allreduce counts differ"};
    record(std::string("argument mismatch: ") + names[kind], ok, why.empty() ? ddp_last_error() : why);
  }
}

// --- grads: shared helpers -----------------------------------------------------------------------

struct Layout {
  int arena, plan;
};

struct Model {
  std::vector<size_t> numel;
  std::vector<ddp_dtype_t> dtype;
  std::vector<GradBuf> copy;  // copy layout: the grads' storage
  std::vector<int> index;
};

Model make_model(std::mt19937_64& shared, bool floats_only32, bool big) {
  Model m;
  const int n = 2 + static_cast<int>(shared() % 8);
  for (int g = 0; g < n; ++g) {
    m.numel.push_back(1 + shared() % (big ? 90000 : 3000));
    m.dtype.push_back(floats_only32 ? (shared() % 2 ? DDP_F32 : DDP_F64) : static_cast<ddp_dtype_t>(shared() % 4));
  }
  return m;
}

bool register_model(ddp_t d, Model& m, bool arena, std::string* why) {
  m.copy.clear();
  m.index.resize(m.numel.size());
  for (size_t g = 0; g < m.numel.size(); ++g) {
    void* p = nullptr;
    if (!arena) {
      m.copy.push_back(grad_buf(m.numel[g] * ref::dsize(m.dtype[g])));
      p = m.copy.back().get();
    }
    EXPECT_OK(ddp_register_grad(d, p, m.numel[g], m.dtype[g], 0, &m.index[g]));
  }
  EXPECT_OK(ddp_commit(d));
  return true;
}

void* grad_of(ddp_t d, Model& m, size_t g, bool arena) {
  if (!arena) return m.copy[g].get();
  void* p = nullptr;
  ddp_grad_ptr(d, m.index[g], &p);
  return p;
}

// Grad g's bytes, copied to the host.
std::vector<char> read_grad(ddp_t d, Model& m, size_t g, bool arena) {
  return grad_read(grad_of(d, m, g, arena), m.numel[g] * ref::dsize(m.dtype[g]));
}

// Writes this rank's grads of iteration `it` and runs one backward pass, marking them in an order of
// this rank's own.
bool backward(ddp_t d, Model& m, bool arena, uint64_t seed, int it, std::mt19937_64& mine, std::string* why) {
  std::vector<size_t> order(m.numel.size());
  for (size_t g = 0; g < order.size(); ++g) {
    order[g] = g;
    std::vector<char> host(m.numel[g] * ref::dsize(m.dtype[g]));
    for (size_t i = 0; i < m.numel[g]; ++i)
      ref::store(host.data(), i, m.dtype[g],
                 ref::quantize(ref::raw_value(seed, g_rank, it, static_cast<int>(g), i), m.dtype[g]));
    grad_write(grad_of(d, m, g, arena), host);
  }
  std::shuffle(order.begin(), order.end(), mine);
  EXPECT_OK(ddp_begin_backward(d, nullptr));
  for (size_t g : order) EXPECT_OK(ddp_grad_ready(d, m.index[g]));
  EXPECT_OK(ddp_finish_backward(d, nullptr));
  return true;
}

std::vector<char> all_bytes(ddp_t d, Model& m, bool arena) {
  std::vector<char> out;
  for (size_t g = 0; g < m.numel.size(); ++g) {
    const std::vector<char> host = read_grad(d, m, g, arena);
    out.insert(out.end(), host.begin(), host.end());
  }
  return out;
}

// The float64 reference of element i of grad g in iteration `it`: the sum of the inputs, as stored,
// of every rank (or, given `batches`, of the ranks with more than `it` batches: the others have
// joined), and the sum of their magnitudes (the scale a rounding error is measured against).
struct Sum {
  double want = 0, mag = 0;
};
Sum reference_sum(uint64_t seed, int it, size_t g, size_t i, ddp_dtype_t dtype, const std::vector<int>* batches) {
  Sum s;
  for (int r = 0; r < g_world; ++r) {
    if (batches && (*batches)[static_cast<size_t>(r)] <= it) continue;  // joined: a zero
    const double v = ref::quantize(ref::raw_value(seed, r, it, static_cast<int>(g), i), dtype);
    s.want += v;
    s.mag += std::fabs(v);
  }
  return s;
}

// --- uneven inputs ---------------------------------------------------------------------------------

bool join_case(const Layout& l, int divide, uint64_t seed, std::string* why) {
  std::mt19937_64 shared(seed), mine(seed * 7 + static_cast<uint64_t>(g_rank));
  Model m = make_model(shared, false, false);
  std::vector<int> batches(static_cast<size_t>(g_world));
  for (int& b : batches) b = static_cast<int>(shared() % 6);  // 0..5: a rank may have no data at all
  const int most = *std::max_element(batches.begin(), batches.end());
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.layout = l.arena;
  cfg.plan_order = l.plan;
  cfg.message_size = 1 + shared() % 4000;
  cfg.uneven_inputs = divide;
  cfg.timeout_ms = 30000;
  ddp_t d = nullptr;
  EXPECT_OK(ddp_create(g_comm, &cfg, &d));
  const Closer closer{d};
  if (!register_model(d, m, l.arena, why)) return false;
  const int mine_batches = batches[static_cast<size_t>(g_rank)];
  for (int it = 0; it < mine_batches; ++it) {
    if (!backward(d, m, l.arena, seed, it, mine, why)) return false;
    int contributors = 0;
    for (int b : batches) contributors += b > it;
    const double scale = 1.0 / (divide == DDP_UNEVEN_BY_WORLD ? g_world : contributors);
    for (size_t g = 0; g < m.numel.size(); ++g) {
      const std::vector<char> host = read_grad(d, m, g, l.arena);
      for (size_t i = 0; i < m.numel[g]; ++i) {
        const Sum sum = reference_sum(seed, it, g, i, m.dtype[g], &batches);
        const double want = sum.want * scale, mag = sum.mag;
        const double got = ref::load(host.data(), i, m.dtype[g]);
        if (!close_reduced(got, want, mag * scale, m.dtype[g])) {
          *why = "iteration " + std::to_string(it) + ", grad " + std::to_string(g) + "[" + std::to_string(i) +
                 "] (dtype " + std::to_string(m.dtype[g]) + "): " + std::to_string(got) + ", want " +
                 std::to_string(want) + " (" + std::to_string(contributors) + " contributors)";
          return false;
        }
      }
    }
  }
  int64_t at = -1;
  EXPECT_OK(ddp_join(d, &at));
  if (at != most) {
    *why = "ddp_join reported iteration " + std::to_string(at) + ", want " + std::to_string(most);
    return false;
  }
  // A new epoch: every rank contributes again and averages divide by the world.
  if (!backward(d, m, l.arena, seed, 77, mine, why)) return false;
  for (size_t g = 0; g < m.numel.size(); ++g) {
    const std::vector<char> host = read_grad(d, m, g, l.arena);
    const Sum sum = reference_sum(seed, 77, g, 0, m.dtype[g], nullptr);
    if (!close_reduced(ref::load(host.data(), 0, m.dtype[g]), sum.want / g_world, sum.mag / g_world, m.dtype[g])) {
      *why = "after ddp_join: grad " + std::to_string(g) + " is not the average over the world";
      return false;
    }
  }
  if (!same_everywhere(all_bytes(d, m, l.arena), why, "reduced grads after ddp_join")) return false;
  ddp_stats_t st;
  st.size = sizeof st;
  EXPECT_OK(ddp_get_stats(d, &st));
  if (st.iterations != static_cast<uint64_t>(most + 1)) {
    *why = "stats.iterations " + std::to_string(st.iterations) + ", want " + std::to_string(most + 1);
    return false;
  }
  return true;
}

// The last rank joins at once; the others reduce twice with ddp_reduce_all (apex's Reducer), which
// neither learns a plan nor reports unused grads: the joined rank must shadow exactly that.
bool join_reduce_all_case(std::string* why) {
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;  // the learned plan, unused grads an error
  cfg.uneven_inputs = DDP_UNEVEN_BY_CONTRIBUTORS;
  cfg.timeout_ms = 30000;
  ddp_t d = nullptr;
  EXPECT_OK(ddp_create(g_comm, &cfg, &d));
  const Closer closer{d};
  const size_t n = 300;
  void* g = grad_alloc(n * sizeof(float));
  int index = 0;
  EXPECT_OK(ddp_register_grad(d, g, n, DDP_F32, 0, &index));
  const bool joined = g_rank == g_world - 1;
  const int contributors = g_world - 1;
  for (int it = 0; it < 2 && !joined; ++it) {
    std::vector<char> bytes(n * sizeof(float));
    for (size_t i = 0; i < n; ++i) ref::store(bytes.data(), i, DDP_F32, g_rank + 1 + it);
    grad_write(g, bytes);
    EXPECT_OK(ddp_reduce_all(d, nullptr));
    const std::vector<char> got = grad_read(g, n * sizeof(float));
    const double want = (contributors + 1) / 2.0 + it;  // the mean of r + 1 + it over the contributors
    if (ref::load(got.data(), 7, DDP_F32) != want) {
      *why = "ddp_reduce_all " + std::to_string(it) + ": " + std::to_string(ref::load(got.data(), 7, DDP_F32)) +
             ", want " + std::to_string(want);
      return false;
    }
  }
  int64_t at = -1;
  EXPECT_OK(ddp_join(d, &at));
  grad_free(g);
  if (at != (g_world > 1 ? 2 : 0)) {
    *why = "ddp_join reported iteration " + std::to_string(at);
    return false;
  }
  return true;
}

void test_join(uint64_t seed) {
  int n = 0;
  for (int arena = 0; arena < 2; ++arena)
    for (int plan = 0; plan < 2; ++plan)
      for (int divide : {DDP_UNEVEN_BY_CONTRIBUTORS, DDP_UNEVEN_BY_WORLD}) {
        std::string why;
        const bool ok = join_case(Layout{arena, plan}, divide, seed + static_cast<uint64_t>(++n) * 101, &why);
        record(std::string("join: ") + (arena ? "arena" : "copy") + (plan ? " registration" : " learned") +
                   (divide == DDP_UNEVEN_BY_WORLD ? " by world" : " by contributors"),
               ok, why);
      }
  {
    std::string why;
    record("join: a joined rank shadows the others' ddp_reduce_all (learned plan, unused grads an error)",
           join_reduce_all_case(&why), why);
  }
  // Misuse.
  std::string why;
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  ddp_t d = nullptr;
  bool ok = ddp_create(g_comm, &cfg, &d) == DDP_SUCCESS &&
            expect_status(ddp_join(d, nullptr), DDP_ERR_INVALID_STATE, "needs config.uneven_inputs", &why);
  ddp_destroy(d);
  record("join: without config.uneven_inputs refused", ok, why);
  cfg.uneven_inputs = DDP_UNEVEN_BY_CONTRIBUTORS;
  cfg.shard = 1;
  cfg.layout = DDP_LAYOUT_ARENA;
  cfg.plan_order = DDP_PLAN_REGISTRATION;
  d = nullptr;
  why.clear();
  ok = expect_status(ddp_create(g_comm, &cfg, &d), DDP_ERR_INVALID_ARGUMENT, "not available with config.shard", &why);
  ddp_destroy(d);
  record("join: uneven_inputs with shard refused", ok, why);
  cfg = DDP_CONFIG_INITIALIZER;
  cfg.uneven_inputs = 3;
  d = nullptr;
  why.clear();
  ok = expect_status(ddp_create(g_comm, &cfg, &d), DDP_ERR_INVALID_ARGUMENT, "uneven_inputs", &why);
  ddp_destroy(d);
  record("join: uneven_inputs 3 refused", ok, why);
}

// --- the 16-bit wire -------------------------------------------------------------------------------

// A compressed wire under test (config.compression): its name, the bytes of one element on it, and
// what one rounding to it costs: `unit` relative to the magnitudes summed, `tiny` absolute below its
// normal range (fp16's subnormals: 2^-24; 0 where there is none in the values' range).
struct Wire {
  int mode;
  const char* name;
  size_t bytes;
  double unit, tiny;
};
const Wire kWires[] = {
    {DDP_COMPRESS_BF16, "bf16", 2, 1.0 / 256, 0.0},
    {DDP_COMPRESS_FP16, "fp16", 2, 1.0 / 2048, 0x1p-24},
};

// `w`: the wire, or nullptr for none (each value then within ref::close of the reference).
bool compression_case(const Layout& l, const Wire* w, uint64_t seed, uint64_t* bytes, std::string* why) {
  std::mt19937_64 shared(seed), mine(seed * 5 + static_cast<uint64_t>(g_rank));
  Model m = make_model(shared, true, shared() % 2 == 0);
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.layout = l.arena;
  cfg.plan_order = l.plan;
  cfg.message_size = 1 + shared() % 200000;
  cfg.compression = w ? w->mode : DDP_COMPRESS_NONE;
  cfg.gradient_predivide_factor = shared() % 2 ? 1.0 : 3.0;
  cfg.timeout_ms = 30000;
  ddp_t d = nullptr;
  EXPECT_OK(ddp_create(g_comm, &cfg, &d));
  const Closer closer{d};
  if (!register_model(d, m, l.arena, why)) return false;
  // The bound of the documentation: an input rounding, one per hop, one for the result (and the
  // pre-division in 16-bit math), each `unit` of the magnitudes summed (2^-8 for bf16, 2^-11 for
  // fp16); below the normal range each costs `tiny` (times the pre-division factor, up to 3).
  const double bound = w ? (g_world + 3) * w->unit : 0.0;
  const double floor = w ? (g_world + 3) * 3.0 * w->tiny : 0.0;
  for (int it = 0; it < 3; ++it) {
    if (!backward(d, m, l.arena, seed, it, mine, why)) return false;
    for (size_t g = 0; g < m.numel.size(); ++g) {
      const std::vector<char> host = read_grad(d, m, g, l.arena);
      for (size_t i = 0; i < m.numel[g]; ++i) {
        const Sum sum = reference_sum(seed, it, g, i, m.dtype[g], nullptr);
        const double want = sum.want / g_world, mag = sum.mag / g_world;
        const double got = ref::load(host.data(), i, m.dtype[g]);
        if (w ? !(std::fabs(got - want) <= bound * mag + floor + 1e-30) : !ref::close(got, want, mag, m.dtype[g])) {
          *why = "iteration " + std::to_string(it) + ", grad " + std::to_string(g) + "[" + std::to_string(i) +
                 "]: " + std::to_string(got) + ", want " + std::to_string(want) +
                 (w ? " within " + std::to_string(bound * mag + floor) : std::string());
          return false;
        }
      }
    }
    if (!same_everywhere(all_bytes(d, m, l.arena), why, "reduced grads")) return false;
  }
  ddp_stats_t st;
  st.size = sizeof st;
  EXPECT_OK(ddp_get_stats(d, &st));
  *bytes = st.bytes_reduced;
  return true;
}

void test_compression(uint64_t seed) {
  int n = 0;
  for (int arena = 0; arena < 2; ++arena)
    for (int plan = 0; plan < 2; ++plan)
      for (const Wire& w : kWires) {
        std::string why;
        const uint64_t s = seed + static_cast<uint64_t>(++n) * 313;
        uint64_t packed = 0, plain = 0;
        bool ok = compression_case(Layout{arena, plan}, &w, s, &packed, &why);
        // The same model uncompressed: the wire carries 4 / w.bytes times fewer bytes for f32, 8 /
        // w.bytes for f64.
        if (ok) ok = compression_case(Layout{arena, plan}, nullptr, s, &plain, &why);
        if (ok && !(packed * 4 <= plain * w.bytes && packed * 8 >= plain * w.bytes)) {
          ok = false;
          why = "bytes reduced: " + std::to_string(packed) + " compressed, " + std::to_string(plain) + " not";
        }
        record(std::string("compression: ") + w.name + (arena ? " arena" : " copy") +
                   (plan ? " registration" : " learned"),
               ok, why);
      }
}

// --- the int8 wire ---------------------------------------------------------------------------------
// The int8 wire (DDP_COMPRESS_INT8), host or device memory: grads of per-grad magnitudes (so that blocks span grads of
// different scales), every reduced value checked against the header's bound itself (tests/support/int8_bound.hpp:
// the formula of include/ddp.h, from the inputs alone).

struct Int8Model {
  std::vector<size_t> numel;
  std::vector<ddp_dtype_t> dtype;
  std::vector<double> mag;  // per grad: the inputs' scale
  std::vector<std::vector<char>> copy;
  std::vector<int> index;
  std::vector<int> bucket;     // per grad
  std::vector<size_t> offset;  // per grad: its first element's place in its bucket
  struct Plant {
    int rank = -1, it = -1;
    size_t g = 0, i = 0;
    double v = 0;
  } plant;  // one value put in place of the random one
};

double int8_input(uint64_t seed, int rank, int it, const Int8Model& m, size_t g, size_t i) {
  const Int8Model::Plant& p = m.plant;
  if (p.rank == rank && p.it == it && p.g == g && p.i == i) return p.v;
  return ref::quantize(ref::raw_value(seed, rank, it, static_cast<int>(g), i) * m.mag[g], m.dtype[g]);
}

// Per grad, where its elements sit in its bucket (blocks are counted from the bucket's start).
bool int8_layout(ddp_t d, Int8Model& m, std::string* why) {
  int nb = 0;
  EXPECT_OK(ddp_get_plan(d, &nb, nullptr));
  m.bucket.assign(m.numel.size(), -1);
  m.offset.assign(m.numel.size(), 0);
  for (int b = 0; b < nb; ++b) {
    ddp_bucket_info_t info;
    info.size = sizeof info;
    std::vector<int> grads(m.numel.size());
    EXPECT_OK(ddp_get_bucket(d, b, &info, grads.data(), grads.size()));
    size_t at = 0;
    for (int k = 0; k < info.num_grads; ++k) {
      const size_t g = static_cast<size_t>(grads[static_cast<size_t>(k)]);
      m.bucket[g] = b;
      m.offset[g] = at;
      at += m.numel[g];
    }
  }
  return true;
}

// max |input| of rank r over every block of iteration `it`, keyed by (bucket, block).
std::map<std::pair<int, size_t>, double> int8_block_max(uint64_t seed, int r, int it, const Int8Model& m) {
  std::map<std::pair<int, size_t>, double> amax;
  for (size_t g = 0; g < m.numel.size(); ++g)
    for (size_t i = 0; i < m.numel[g]; ++i) {
      double& a = amax[{m.bucket[g], (m.offset[g] + i) / 256}];
      a = std::max(a, std::fabs(int8_input(seed, r, it, m, g, i)));
    }
  return amax;
}

// Runs `iters` iterations (inputs of iteration `it % period`: a period of 1 repeats one input) and
// checks each against the per-block bound; with `mean`, also the mean over the iterations against a
// bound `iters` times tighter (the error feedback at work). `nan_at`: an iteration where the last
// rank's grad 0 element 0 is NaN.
// Frees the grad storage a case allocated (grad_alloc) when it returns; declared after the context's
// Closer, so it runs first.
struct Frees {
  std::vector<void*>* ptrs;
  ~Frees() {
    for (void* p : *ptrs)
      if (p) grad_free(p);
  }
};

bool int8_case(const Layout& l, int compression, uint64_t seed, int iters, int period, bool mean, int nan_at,
               uint64_t* bytes, std::string* why) {
  std::mt19937_64 shared(seed), mine(seed * 11 + static_cast<uint64_t>(g_rank));
  Int8Model m;
  const int n = 2 + static_cast<int>(shared() % 7);
  for (int g = 0; g < n; ++g) {
    m.numel.push_back(1 + shared() % 2000);
    m.dtype.push_back(shared() % 3 ? DDP_F32 : DDP_F64);
    m.mag.push_back(std::ldexp(1.0, static_cast<int>(shared() % 13) - 6));
  }
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.layout = l.arena;
  cfg.plan_order = l.plan;
  cfg.message_size = 1 + shared() % 5000;
  cfg.compression = compression;
  cfg.gradient_predivide_factor = shared() % 2 ? 1.0 : 3.0;
  cfg.num_streams = 1 + static_cast<int>(shared() % 2);
  cfg.host_piece_bytes = shared() % 2 ? 0 : 4096;  // the all-gather in rounds of 4 blocks, scaled per round
  cfg.timeout_ms = 30000;
  ddp_t d = nullptr;
  EXPECT_OK(ddp_create(g_comm, &cfg, &d));
  const Closer closer{d};
  // The mean's bound below: the reduce-scatter (from world 3, by default) re-quantizes each shard's
  // sum and feeds that rounding back too, a second error of the same size.
  const double requant = g_world >= 3 ? 2.0 : 1.0;
  const double pre = cfg.gradient_predivide_factor, post = pre / g_world;
  std::vector<int8_bound::Int8Bound> bounds;  // per bucket, made once the plan of iteration 0 is known
  // m.copy[g]: the host image of grad g, written to and read back from its storage (device memory
  // over NCCL), which the copy layout allocates here and the arena layout names.
  m.copy.resize(m.numel.size());
  m.index.resize(m.numel.size());
  std::vector<void*> mine_storage(m.numel.size(), nullptr);
  const Frees frees{&mine_storage};
  for (size_t g = 0; g < m.numel.size(); ++g) {
    m.copy[g].assign(m.numel[g] * ref::dsize(m.dtype[g]), 0);
    if (!l.arena) mine_storage[g] = grad_alloc(m.copy[g].size());
    EXPECT_OK(ddp_register_grad(d, mine_storage[g], m.numel[g], m.dtype[g], 0, &m.index[g]));
  }
  EXPECT_OK(ddp_commit(d));
  if (!int8_layout(d, m, why)) return false;
  auto storage = [&](size_t g) -> void* {
    void* p = mine_storage[g];
    if (l.arena) ddp_grad_ptr(d, m.index[g], &p);
    return p;
  };
  auto ptr = [&](size_t g) -> void* { return m.copy[g].data(); };
  std::vector<std::vector<double>> sum(m.numel.size());
  for (size_t g = 0; g < m.numel.size(); ++g) sum[g].assign(m.numel[g], 0.0);
  std::vector<std::map<std::pair<int, size_t>, double>> prev(static_cast<size_t>(g_world));
  for (int it = 0; it < iters; ++it) {
    const int in = it % period;
    std::vector<size_t> order(m.numel.size());
    for (size_t g = 0; g < m.numel.size(); ++g) {
      order[g] = g;
      for (size_t i = 0; i < m.numel[g]; ++i) ref::store(ptr(g), i, m.dtype[g], int8_input(seed, g_rank, in, m, g, i));
    }
    if (it == nan_at && g_rank == g_world - 1) ref::store(ptr(0), 0, m.dtype[0], std::nan(""));
    for (size_t g = 0; g < m.numel.size(); ++g) grad_write(storage(g), m.copy[g]);
    std::shuffle(order.begin(), order.end(), mine);
    EXPECT_OK(ddp_begin_backward(d, nullptr));
    for (size_t g : order) EXPECT_OK(ddp_grad_ready(d, m.index[g]));
    EXPECT_OK(ddp_finish_backward(d, nullptr));
    // A learned plan is adopted at the end of iteration 0, before that iteration's reduction.
    if (it == 0 && !int8_layout(d, m, why)) return false;
    if (it == 0) {
      int nb = 0;
      EXPECT_OK(ddp_get_plan(d, &nb, nullptr));
      std::vector<size_t> bn(static_cast<size_t>(nb), 0);
      std::vector<bool> f32(static_cast<size_t>(nb), true);
      for (size_t g = 0; g < m.numel.size(); ++g) {
        bn[static_cast<size_t>(m.bucket[g])] += m.numel[g];
        f32[static_cast<size_t>(m.bucket[g])] = m.dtype[g] == DDP_F32;
      }
      for (int b = 0; b < nb; ++b)
        bounds.emplace_back(bn[static_cast<size_t>(b)], g_world, f32[static_cast<size_t>(b)],
                            int8_model::scatters(bn[static_cast<size_t>(b)], g_world, 3));
    }
    for (size_t g = 0; g < m.numel.size(); ++g) m.copy[g] = grad_read(storage(g), m.copy[g].size());
    std::vector<char> reduced;
    for (size_t g = 0; g < m.numel.size(); ++g)
      reduced.insert(reduced.end(), static_cast<char*>(ptr(g)), static_cast<char*>(ptr(g)) + m.copy[g].size());
    if (!same_everywhere(reduced, why, "reduced grads")) return false;
    if (compression != DDP_COMPRESS_INT8) continue;  // (the uncompressed run only counts bytes)
    std::vector<std::map<std::pair<int, size_t>, double>> now(static_cast<size_t>(g_world));
    for (int r = 0; r < g_world; ++r) now[static_cast<size_t>(r)] = int8_block_max(seed, r, in, m);
    // The header's bound per bucket element, from every rank's values (grad / predivide factor).
    std::vector<std::vector<double>> bound_of(bounds.size());
    for (size_t b = 0; b < bounds.size(); ++b) {
      size_t bn = 0;
      for (size_t g = 0; g < m.numel.size(); ++g)
        if (m.bucket[g] == static_cast<int>(b)) bn += m.numel[g];
      std::vector<std::vector<double>> xs(static_cast<size_t>(g_world), std::vector<double>(bn));
      for (size_t g = 0; g < m.numel.size(); ++g)
        if (m.bucket[g] == static_cast<int>(b))
          for (int r = 0; r < g_world; ++r)
            for (size_t i = 0; i < m.numel[g]; ++i) {
              double v = int8_input(seed, r, in, m, g, i);
              if (it == nan_at && r == g_world - 1 && g == 0 && i == 0) v = 0;  // (its block is skipped)
              xs[static_cast<size_t>(r)][m.offset[g] + i] = v / pre;
            }
      bound_of[b] = bounds[b].step(xs);
    }
    for (size_t g = 0; g < m.numel.size(); ++g)
      for (size_t i = 0; i < m.numel[g]; ++i) {
        const std::pair<int, size_t> block{m.bucket[g], (m.offset[g] + i) / 256};
        double want = 0;
        for (int r = 0; r < g_world; ++r) want += int8_input(seed, r, in, m, g, i) / pre;
        const double u = m.dtype[g] == DDP_F32 ? std::ldexp(1.0, -24) : std::ldexp(1.0, -53);
        const double result = ref::load(ptr(g), i, m.dtype[g]), got = result * g_world;
        const double bound = post * bound_of[static_cast<size_t>(m.bucket[g])][m.offset[g] + i] + u * std::fabs(result);
        if (it == nan_at && g == 0 && i == 0) {
          if (!std::isnan(got)) {
            *why = "iteration " + std::to_string(it) + ": a NaN input gave " + std::to_string(got);
            return false;
          }
          continue;
        }
        if (it == nan_at && block.first == m.bucket[0] && block.second == m.offset[0] / 256) continue;  // NaN block
        if (!(std::fabs(result - post * want) <= bound)) {
          char text[256];
          std::snprintf(text, sizeof text,
                        "iteration %d, grad %zu[%zu] (dtype %d): %.17g, exact %.17g, past the header's bound %.17g", it,
                        g, i, static_cast<int>(m.dtype[g]), result, post * want, bound);
          *why = text;
          return false;
        }
        if (mean && it > 0) sum[g][i] += got;  // (iteration 0 starts the feedback from nothing)
      }
    prev = now;
  }
  if (mean)
    for (size_t g = 0; g < m.numel.size(); ++g)
      for (size_t i = 0; i < m.numel[g]; ++i) {
        double want = 0, bound = 0;
        for (int r = 0; r < g_world; ++r) {
          want += int8_input(seed, r, 0, m, g, i);
          bound += 2.0 * prev[static_cast<size_t>(r)][{m.bucket[g], (m.offset[g] + i) / 256}] * 1.02 / 254.0;
        }
        bound *= requant;
        const double avg = sum[g][i] / (iters - 1);
        if (!(std::fabs(avg - want) <= bound / (iters - 1) + 1e-6 * std::fabs(want) + 1e-30)) {
          *why = "error feedback: grad " + std::to_string(g) + "[" + std::to_string(i) + "]: mean over " +
                 std::to_string(iters - 1) + " iterations " + std::to_string(avg) + ", want " + std::to_string(want) +
                 " within " + std::to_string(bound / (iters - 1));
          return false;
        }
      }
  if (bytes) {
    ddp_stats_t st;
    st.size = sizeof st;
    EXPECT_OK(ddp_get_stats(d, &st));
    *bytes = st.bytes_reduced;
  }
  return true;
}

// --- the int8 wire, exact: both collectives against the float64 model of the same quantization
// (tests/support/int8_model.hpp). No averaging, no pre-division: the sums themselves are compared.

// `iters` iterations of fresh inputs (with per-grad magnitudes, so that blocks span scales) through
// the int8 wire with DDP_INT8_SCATTER_MIN_WORLD = `min_world`; every rank's reduced grads must equal
// the model's bit for bit. *sent: ddp_stats_t.bytes_sent at the end.
bool int8_exact_case(int arena, int min_world, uint64_t seed, int iters, uint64_t* sent, std::string* why) {
  std::mt19937_64 shared(seed), mine(seed * 13 + static_cast<uint64_t>(g_rank));
  Int8Model m;
  const int n = 1 + static_cast<int>(shared() % 6);
  for (int g = 0; g < n; ++g) {
    // Grad 0 is an f32 one of several blocks per rank, so that the reduce-scatter has a bucket to
    // gain on at 3 and 4 ranks; the others also small (a few blocks, some ranks' shards empty).
    m.numel.push_back(g == 0 ? 2000 + shared() % 6000 : 1 + shared() % (shared() % 4 ? 1500 : 6000));
    m.dtype.push_back(g == 0 || shared() % 3 ? DDP_F32 : DDP_F64);
    m.mag.push_back(std::ldexp(1.0, static_cast<int>(shared() % 13) - 6));
  }
  // Iteration 2: a magnitude past the fp32 range (FLT_MAX to 1e300) in one rank's f64 grad, if any:
  // its block is NaN everywhere (the model says which), the next iteration clean.
  for (size_t g = 0; g < m.numel.size(); ++g)
    if (m.dtype[g] == DDP_F64) {
      const double lo = std::log10(std::nextafter(static_cast<double>(FLT_MAX), INFINITY));
      m.plant.rank = static_cast<int>(shared() % static_cast<uint64_t>(g_world));
      m.plant.it = 2;
      m.plant.g = g;
      m.plant.i = shared() % m.numel[g];
      m.plant.v =
          (shared() % 2 ? 1 : -1) * std::pow(10.0, lo + (300 - lo) * static_cast<double>(shared() % 1000) / 999);
      break;
    }
  setenv("DDP_INT8_SCATTER_MIN_WORLD", std::to_string(min_world).c_str(), 1);
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.layout = arena;
  cfg.plan_order = DDP_PLAN_REGISTRATION;
  cfg.message_size = 1 + shared() % 20000;
  cfg.compression = DDP_COMPRESS_INT8;
  cfg.gradient_average = 0;
  cfg.num_streams = 1 + static_cast<int>(shared() % 2);
  // Small host pieces make the all-gather go in rounds of a few blocks (4096 bytes: 4 blocks).
  const size_t pieces[] = {0, 4096, 8192, 20480};
  cfg.host_piece_bytes = pieces[shared() % 4];
  cfg.timeout_ms = 30000;
  ddp_t d = nullptr;
  const ddp_status_t created = ddp_create(g_comm, &cfg, &d);
  unsetenv("DDP_INT8_SCATTER_MIN_WORLD");
  EXPECT_OK(created);
  const Closer closer{d};
  m.copy.resize(m.numel.size());
  m.index.resize(m.numel.size());
  std::vector<void*> storage_of(m.numel.size(), nullptr);
  const Frees frees{&storage_of};
  for (size_t g = 0; g < m.numel.size(); ++g) {
    m.copy[g].assign(m.numel[g] * ref::dsize(m.dtype[g]), 0);
    if (!arena) storage_of[g] = grad_alloc(m.copy[g].size());
    EXPECT_OK(ddp_register_grad(d, storage_of[g], m.numel[g], m.dtype[g], 0, &m.index[g]));
  }
  EXPECT_OK(ddp_commit(d));
  if (!int8_layout(d, m, why)) return false;
  int nb = 0;
  EXPECT_OK(ddp_get_plan(d, &nb, nullptr));
  std::vector<size_t> bucket_n(static_cast<size_t>(nb), 0);
  std::vector<bool> bucket_f32(static_cast<size_t>(nb), true);
  for (size_t g = 0; g < m.numel.size(); ++g) {
    bucket_n[static_cast<size_t>(m.bucket[g])] += m.numel[g];
    bucket_f32[static_cast<size_t>(m.bucket[g])] = m.dtype[g] == DDP_F32;
  }
  const size_t W = static_cast<size_t>(g_world);
  // The model's state: per bucket, every rank's kept errors and every owner's shard errors.
  std::vector<std::vector<std::vector<double>>> res(static_cast<size_t>(nb)), shard(static_cast<size_t>(nb));
  for (int b = 0; b < nb; ++b) {
    res[static_cast<size_t>(b)].assign(W, std::vector<double>(bucket_n[static_cast<size_t>(b)], 0.0));
    shard[static_cast<size_t>(b)].assign(W, std::vector<double>());
  }
  auto storage = [&](size_t g) -> void* {
    void* p = storage_of[g];
    if (arena) ddp_grad_ptr(d, m.index[g], &p);
    return p;
  };
  for (int it = 0; it < iters; ++it) {
    std::vector<size_t> order(m.numel.size());
    for (size_t g = 0; g < m.numel.size(); ++g) {
      order[g] = g;
      for (size_t i = 0; i < m.numel[g]; ++i)
        ref::store(m.copy[g].data(), i, m.dtype[g], int8_input(seed, g_rank, it, m, g, i));
      grad_write(storage(g), m.copy[g]);
    }
    std::shuffle(order.begin(), order.end(), mine);
    EXPECT_OK(ddp_begin_backward(d, nullptr));
    for (size_t g : order) EXPECT_OK(ddp_grad_ready(d, m.index[g]));
    EXPECT_OK(ddp_finish_backward(d, nullptr));
    for (int b = 0; b < nb; ++b) {
      const size_t bn = bucket_n[static_cast<size_t>(b)];
      std::vector<std::vector<double>> xs(W, std::vector<double>(bn));
      for (size_t g = 0; g < m.numel.size(); ++g)
        if (m.bucket[g] == b)
          for (int r = 0; r < g_world; ++r)
            for (size_t i = 0; i < m.numel[g]; ++i)
              xs[static_cast<size_t>(r)][m.offset[g] + i] = int8_input(seed, r, it, m, g, i);
      const bool scatter = int8_model::scatters(bn, g_world, min_world);
      const std::vector<double> want = int8_model::model_int8(
          xs, res[static_cast<size_t>(b)], shard[static_cast<size_t>(b)], scatter, bucket_f32[static_cast<size_t>(b)]);
      for (size_t g = 0; g < m.numel.size(); ++g) {
        if (m.bucket[g] != b) continue;
        const std::vector<char> got = grad_read(storage(g), m.copy[g].size());
        for (size_t i = 0; i < m.numel[g]; ++i) {
          const double v = ref::load(got.data(), i, m.dtype[g]), w = want[m.offset[g] + i];
          const bool same = std::isnan(v) ? std::isnan(w) : v == w && std::signbit(v) == std::signbit(w);
          if (it == m.plant.it && g == m.plant.g && i == m.plant.i && !std::isnan(v)) {
            *why = "iteration " + std::to_string(it) + ": a magnitude of " + std::to_string(m.plant.v) +
                   " in an f64 grad came back finite: " + std::to_string(v);
            return false;
          }
          if (!same) {
            char text[256];
            std::snprintf(text, sizeof text,
                          "iteration %d, bucket %d (%s, %zu elements, %s), grad %zu[%zu]: %.17g, the model %.17g", it,
                          b, bucket_f32[static_cast<size_t>(b)] ? "f32" : "f64", bn,
                          scatter ? "reduce-scatter" : "all-gather", g, i, v, w);
            *why = text;
            return false;
          }
        }
      }
    }
  }
  ddp_stats_t st;
  st.size = sizeof st;
  EXPECT_OK(ddp_get_stats(d, &st));
  *sent = st.bytes_sent;
  return true;
}

void test_int8_exact(uint64_t seed) {
  for (int arena = 0; arena < 2; ++arena) {
    const std::string name = arena ? " (arena)" : " (copy)";
    const uint64_t s = seed + static_cast<uint64_t>(arena) * 7919;
    std::string why;
    uint64_t by_gather = 0, by_scatter = 0;
    record("int8 exact: the all-gather equals the float64 model bit for bit, an f64 magnitude past FLT_MAX NaN" + name,
           int8_exact_case(arena, 1 << 30, s, 4, &by_gather, &why), why);
    why.clear();
    record(
        "int8 exact: the reduce-scatter equals the float64 model bit for bit, an f64 magnitude past FLT_MAX NaN" + name,
        int8_exact_case(arena, 1, s, 4, &by_scatter, &why), why);
    // At world 3 and above the reduce-scatter sends fewer bytes: 2 (world - 1) shards of a chunk of
    // about chunk / world, against (world - 1) whole chunks (grad 0's bucket gains; a bucket too small
    // to gain all-gathers either way).
    why.clear();
    bool ok = true;
    if (g_world >= 3 && !(by_scatter < by_gather)) {
      ok = false;
      why = "bytes sent: reduce-scatter " + std::to_string(by_scatter) + ", all-gather " + std::to_string(by_gather);
    }
    if (g_world == 1 && (by_scatter != 0 || by_gather != 0)) {
      ok = false;
      why = "world 1 sent bytes";
    }
    record("int8 exact: the reduce-scatter's bytes stay a quarter of fp32's at any world size" + name, ok, why);
  }
}

ddp_status_t int8_no_hook(const ddp_hook_bucket_t*, void*) { return DDP_SUCCESS; }

void test_int8(uint64_t seed) {
  int n = 0;
  for (int arena = 0; arena < 2; ++arena)
    for (int plan = 0; plan < 2; ++plan) {
      const Layout l{arena, plan};
      const std::string name = std::string(arena ? " arena" : " copy") + (plan ? " registration" : " learned");
      const uint64_t s = seed + static_cast<uint64_t>(++n) * 419;
      std::string why;
      const int q = DDP_COMPRESS_INT8;
      record("int8: fresh inputs, per-block bound" + name, int8_case(l, q, s, 4, 4, false, -1, nullptr, &why), why);
      why.clear();
      record("int8: one input repeated, the mean converges (error feedback)" + name,
             int8_case(l, q, s + 1, 17, 1, true, -1, nullptr, &why), why);
      why.clear();
      record("int8: a NaN block is NaN everywhere, the next iteration is clean" + name,
             int8_case(l, q, s + 2, 4, 4, false, 2, nullptr, &why), why);
      // The wire carries a quarter of the fp32 bytes (an eighth of f64's) in its values, plus a scale
      // per block of 256 (4 bytes for 1 KiB of f32) and, per bucket and iteration, the last block's
      // scale and up to 7 bytes of padding: with the case's tiny random buckets (2 to 8 grads of 1 to
      // 2000 elements, 2 iterations) these may weigh more than the quarter itself.
      why.clear();
      uint64_t packed = 0, plain = 0;
      bool ok = int8_case(l, q, s + 3, 2, 2, false, -1, &packed, &why) &&
                int8_case(l, DDP_COMPRESS_NONE, s + 3, 2, 2, false, -1, &plain, &why);
      const uint64_t per_bucket = 2 * 8 * (4 + 7);  // iterations x buckets at most x (scale + padding)
      if (ok && !(packed <= plain / 4 + plain / 256 + per_bucket && packed < plain)) {
        ok = false;
        why = "bytes reduced: " + std::to_string(packed) + " int8, " + std::to_string(plain) + " uncompressed";
      }
      record("int8: bytes on the wire" + name, ok, why);
    }
  std::string why;
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.compression = DDP_COMPRESS_INT8;
  cfg.shard = 1;
  cfg.layout = DDP_LAYOUT_ARENA;
  cfg.plan_order = DDP_PLAN_REGISTRATION;
  ddp_t d = nullptr;
  bool ok =
      expect_status(ddp_create(g_comm, &cfg, &d), DDP_ERR_INVALID_ARGUMENT, "not available with config.shard", &why);
  ddp_destroy(d);
  d = nullptr;
  cfg = DDP_CONFIG_INITIALIZER;
  cfg.compression = DDP_COMPRESS_INT8;
  ok = ok && ddp_create(g_comm, &cfg, &d) == DDP_SUCCESS &&
       expect_status(ddp_set_comm_hook(d, int8_no_hook, nullptr), DDP_ERR_INVALID_STATE, "compression", &why);
  ddp_destroy(d);
  record("int8: with shard or a comm hook refused", ok, why);
}

// --- comm hooks ------------------------------------------------------------------------------------

// Hooks of buckets on different streams run at once on their workers: the counts are atomic.
struct HookLog {
  std::atomic<int> calls{0};
  int fail_at = -1;  // the call that returns an error
  std::atomic<size_t> elements{0};
  ddp_op_t op = DDP_OP_SUM;  // what the hook asks of ddp_comm_allreduce
  ddp_t ctx = nullptr;       // set: the hook calls back into its own context (refused)
  std::atomic<int> refused{0};
  std::string refusal;  // the first refusal's message
};

// A call back into the hook's own context: refused at once with DDP_ERR_INVALID_STATE (no deadlock).
void reenter(HookLog* log) {
  ddp_stats_t st;
  st.size = sizeof st;
  if (ddp_get_stats(log->ctx, &st) == DDP_ERR_INVALID_STATE &&
      std::strstr(ddp_last_error(), "called from inside this context's comm hook (bucket ") &&
      std::strstr(ddp_last_error(), "only ddp_comm_allreduce on bucket->comm") && log->refused++ == 0)
    log->refusal = ddp_last_error();
}

ddp_status_t summing_hook(const ddp_hook_bucket_t* b, void* user) {
  HookLog* log = static_cast<HookLog*>(user);
  if (log->calls++ == log->fail_at) return DDP_ERR_INVALID_ARGUMENT;
  log->elements += b->count;
  if (b->size < sizeof(ddp_hook_bucket_t) || b->world != g_world || b->rank != g_rank) return DDP_ERR_INTERNAL;
  if (log->ctx) reenter(log);
  return ddp_comm_allreduce(b->comm, b->buffer, b->count, b->dtype, log->op, b->stream);
}

// With a hook the library scales nothing (torch's semantics): an averaging hook leaves the average,
// a summing one the sum, whatever gradient_average and gradient_predivide_factor say.
bool hook_case(const Layout& l, uint64_t seed, ddp_op_t op, std::string* why) {
  std::mt19937_64 shared(seed), mine(seed * 3 + static_cast<uint64_t>(g_rank));
  Model m = make_model(shared, false, false);
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.layout = l.arena;
  cfg.plan_order = l.plan;
  cfg.message_size = 1 + shared() % 4000;
  cfg.num_streams = 1 + static_cast<int>(shared() % 2);
  cfg.gradient_predivide_factor = shared() % 2 ? 1.0 : 2.0;
  cfg.gradient_average = op == DDP_OP_AVG || shared() % 2 ? 1 : 0;
  cfg.timeout_ms = 30000;
  ddp_t d = nullptr;
  EXPECT_OK(ddp_create(g_comm, &cfg, &d));
  const Closer closer{d};
  HookLog log;
  log.op = op;
  log.ctx = d;  // every call also tries ddp_get_stats on its own context: refused, never a deadlock
  const double div = op == DDP_OP_AVG ? g_world : 1.0;
  EXPECT_OK(ddp_set_comm_hook(d, summing_hook, &log));
  if (!register_model(d, m, l.arena, why)) return false;
  if (!expect_status(ddp_set_comm_hook(d, summing_hook, &log), DDP_ERR_INVALID_STATE, "before the first backward", why))
    return false;
  size_t total = 0;
  for (size_t n : m.numel) total += n;
  for (int it = 0; it < 3; ++it) {
    const size_t before = log.elements;
    if (!backward(d, m, l.arena, seed, it, mine, why)) return false;
    if (log.elements - before != total) {
      *why = "iteration " + std::to_string(it) + ": the hook saw " + std::to_string(log.elements - before) +
             " elements of " + std::to_string(total);
      return false;
    }
    for (size_t g = 0; g < m.numel.size(); ++g) {
      const std::vector<char> host = read_grad(d, m, g, l.arena);
      for (size_t i = 0; i < m.numel[g]; ++i) {
        const Sum sum = reference_sum(seed, it, g, i, m.dtype[g], nullptr);
        // 16-bit grads: the hook gets them as the library would send them (fp32 on host comms, their
        // own type on NCCL).
        if (!close_reduced(ref::load(host.data(), i, m.dtype[g]), sum.want / div, sum.mag / div, m.dtype[g])) {
          *why = "iteration " + std::to_string(it) + ", grad " + std::to_string(g) + ": got " +
                 std::to_string(ref::load(host.data(), i, m.dtype[g])) + ", not the hook's " +
                 (op == DDP_OP_AVG ? "average " : "sum ") + std::to_string(sum.want / div);
          return false;
        }
      }
    }
    if (!same_everywhere(all_bytes(d, m, l.arena), why, "reduced grads")) return false;
  }
  if (log.refused != log.calls) {
    *why = "a hook's ddp_get_stats on its own context: " + std::to_string(log.refused) + " of " +
           std::to_string(log.calls) + " calls refused as they should (last: " + log.refusal + ")";
    return false;
  }
  return true;
}

void test_hooks(uint64_t seed) {
  int n = 0;
  for (int arena = 0; arena < 2; ++arena)
    for (int plan = 0; plan < 2; ++plan) {
      std::string why;
      const ddp_op_t op = (arena + plan) % 2 ? DDP_OP_SUM : DDP_OP_AVG;
      const bool ok = hook_case(Layout{arena, plan}, seed + static_cast<uint64_t>(++n) * 577, op, &why);
      record(std::string("hook: ") + (op == DDP_OP_AVG ? "averaging" : "summing") +
                 " over ddp_comm_allreduce is the result (no library scaling; re-entry refused), " +
                 (arena ? "arena" : "copy") + (plan ? " registration" : " learned"),
             ok, why);
    }
  // A hook that fails on every rank at its second call: the iteration fails and the context aborts.
  {
    std::string why;
    ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
    cfg.plan_order = DDP_PLAN_REGISTRATION;
    cfg.message_size = 10;
    cfg.timeout_ms = 30000;
    ddp_t d = nullptr;
    HookLog log;
    log.fail_at = 1;
    const GradBuf a = grad_buf(20 * sizeof(float)), b = grad_buf(20 * sizeof(float));
    int ia = 0, ib = 0;
    bool ok = ddp_create(g_comm, &cfg, &d) == DDP_SUCCESS && ddp_set_comm_hook(d, summing_hook, &log) == DDP_SUCCESS &&
              ddp_register_grad(d, a.get(), 20, DDP_F32, 0, &ia) == DDP_SUCCESS &&
              ddp_register_grad(d, b.get(), 20, DDP_F32, 0, &ib) == DDP_SUCCESS &&
              ddp_begin_backward(d, nullptr) == DDP_SUCCESS && ddp_grad_ready(d, ib) == DDP_SUCCESS;
    // Grad ia completes bucket 1, whose hook fails: on host memory in the bucket's worker; on GPUs on
    // this thread, which launches the bucket, so ddp_grad_ready reports it first.
    const char* failed = "comm hook returned 1 (invalid argument) for bucket 1";
    ok = ok &&
         expect_status(ddp_grad_ready(d, ia), DDP_TEST_NCCL ? DDP_ERR_ABORTED : DDP_SUCCESS,
                       DDP_TEST_NCCL ? failed : nullptr, &why) &&
         expect_status(ddp_finish_backward(d, nullptr), DDP_ERR_ABORTED, failed, &why) &&
         expect_status(ddp_begin_backward(d, nullptr), DDP_ERR_ABORTED, "aborted", &why);
    ddp_destroy(d);
    record("hook: a failing hook fails the iteration and aborts the context", ok, why);
  }
  // Ranks that disagree on setting a hook (rank 0 alone, or every rank but rank 0): the first backward
  // (which closes registration) fails on every rank, naming both sides, and the context aborts.
  for (int alone = 1; g_world >= 2 && alone >= 0; --alone) {
    std::string why;
    ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
    cfg.timeout_ms = 30000;
    ddp_t d = nullptr;
    HookLog log;
    std::vector<float> a(20, 1.0f);
    int ia = 0;
    const bool mine = (g_rank == 0) == (alone == 1);
    std::string with = "rank 0", without = g_world == 2 ? "rank 1" : "ranks 1";
    for (int r = 2; r < g_world; ++r) without += ", " + std::to_string(r);
    if (!alone) std::swap(with, without);
    bool ok = ddp_create(g_comm, &cfg, &d) == DDP_SUCCESS &&
              (!mine || ddp_set_comm_hook(d, summing_hook, &log) == DDP_SUCCESS) &&
              ddp_register_grad(d, a.data(), a.size(), DDP_F32, 0, &ia) == DDP_SUCCESS;
    if (!ok) why = std::string("setup: ") + ddp_last_error();
    ok = ok &&
         expect_status(ddp_begin_backward(d, nullptr), DDP_ERR_MISMATCH,
                       (with + " set one (ddp_set_comm_hook) but " + without + " did not").c_str(), &why) &&
         expect_status(ddp_begin_backward(d, nullptr), DDP_ERR_ABORTED, "comm hook", &why) && log.calls == 0;
    ddp_destroy(d);
    record(std::string("hook: set on ") + (alone ? "rank 0 alone" : "every rank but rank 0") +
               ", DDP_ERR_MISMATCH on every rank naming both sides",
           ok, why);
  }
  // Misuse of the hook and of ddp_comm_allreduce.
  {
    std::string why;
    ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
    cfg.compression = DDP_COMPRESS_BF16;
    ddp_t d = nullptr;
    bool ok = ddp_create(g_comm, &cfg, &d) == DDP_SUCCESS &&
              expect_status(ddp_set_comm_hook(d, summing_hook, nullptr), DDP_ERR_INVALID_STATE, "compression", &why);
    ddp_destroy(d);
    float x[3] = {1, 2, 3};
    ok = ok &&
         expect_status(ddp_comm_allreduce(g_comm, x, 3, DDP_F32, DDP_OP_MAX, nullptr), DDP_ERR_INVALID_ARGUMENT,
                       "sums (DDP_OP_SUM) or averages", &why) &&
         expect_status(ddp_comm_allreduce(g_comm, x, 3, DDP_I32, DDP_OP_SUM, nullptr), DDP_ERR_INVALID_ARGUMENT,
                       "not a float ddp_dtype_t", &why) &&
         expect_status(ddp_comm_allreduce(nullptr, x, 3, DDP_F32, DDP_OP_SUM, nullptr), DDP_ERR_INVALID_ARGUMENT,
                       "NULL", &why);
    // Outside a hook, on a host comm: an ordinary collective; on a device comm refused (the caller
    // reduces device memory with NCCL on a stream of its own).
    float y[3] = {1.0f * static_cast<float>(g_rank), 1, 2};
    if (DDP_TEST_NCCL) {
      const GradBuf dy = grad_buf(sizeof y);
      ok = ok && expect_status(ddp_comm_allreduce(g_comm, dy.get(), 3, DDP_F32, DDP_OP_AVG, nullptr),
                               DDP_ERR_UNSUPPORTED, "outside a comm hook", &why);
    } else {
      ok = ok && ddp_comm_allreduce(g_comm, y, 3, DDP_F32, DDP_OP_AVG, nullptr) == DDP_SUCCESS &&
           y[0] == static_cast<float>(g_world - 1) / 2.0f && y[1] == 1.0f && y[2] == 2.0f;
    }
    if (!ok && why.empty()) why = std::string("ddp_comm_allreduce average: ") + ddp_last_error();
    record("hook: misuse refused; ddp_comm_allreduce outside a hook", ok, why);
  }
}

// --- bytes on the wire ----------------------------------------------------------------------------

// A hook that sends the bucket as bf16 (half the bytes), averaged, and reads it back.
ddp_status_t bf16_hook(const ddp_hook_bucket_t* b, void* user) {
  std::vector<uint16_t>& wire = *static_cast<std::vector<uint16_t>*>(user);
  const float* x = static_cast<const float*>(b->buffer);
  wire.resize(b->count);
  for (size_t i = 0; i < b->count; ++i) {
    uint32_t u;
    std::memcpy(&u, &x[i], 4);
    wire[i] = static_cast<uint16_t>(u >> 16);
  }
  const ddp_status_t st = ddp_comm_allreduce(b->comm, wire.data(), b->count, DDP_BF16, DDP_OP_AVG, b->stream);
  for (size_t i = 0; i < b->count; ++i) {
    const uint32_t u = static_cast<uint32_t>(wire[i]) << 16;
    std::memcpy(static_cast<float*>(b->buffer) + i, &u, 4);
  }
  return st;
}

// One f32 grad of n elements in one bucket (n divisible by every world size of the suite, large enough
// for the host ring): what one steady iteration sent and received (`hook`: through bf16_hook).
bool wire_iteration(size_t n, bool hook, uint64_t* sent, uint64_t* received, uint64_t* payload, std::string* why) {
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.plan_order = DDP_PLAN_REGISTRATION;
  cfg.unused_policy = DDP_UNUSED_ZERO;  // no unused-grad report: the iteration is the bucket alone
  cfg.timeout_ms = 30000;
  ddp_t d = nullptr;
  EXPECT_OK(ddp_create(g_comm, &cfg, &d));
  const Closer closer{d};
  std::vector<uint16_t> wire;
  if (hook) EXPECT_OK(ddp_set_comm_hook(d, bf16_hook, &wire));
  const GradBuf g = grad_buf(n * sizeof(float));
  int idx = 0;
  EXPECT_OK(ddp_register_grad(d, g.get(), n, DDP_F32, 0, &idx));
  ddp_stats_t s0, s1;
  s0.size = s1.size = sizeof(ddp_stats_t);
  for (int it = 0; it < 2; ++it) {
    EXPECT_OK(ddp_get_stats(d, &s0));
    EXPECT_OK(ddp_begin_backward(d, nullptr));
    EXPECT_OK(ddp_grad_ready(d, idx));
    EXPECT_OK(ddp_finish_backward(d, nullptr));
    EXPECT_OK(ddp_get_stats(d, &s1));
  }
  *sent = s1.bytes_sent - s0.bytes_sent;
  *received = s1.bytes_received - s0.bytes_received;
  *payload = s1.bytes_reduced - s0.bytes_reduced;
  return true;
}

void test_wire_bytes() {
  const size_t n = size_t(3) << 17;  // 1.5 MiB of f32: one ring piece, divisible by 1..4 ranks
  // Per rank 2 (w - 1) / w of the bucket: none on one rank, 1x at 2 ranks, 1.5x at 4.
  const uint64_t w = static_cast<uint64_t>(g_world), ring = 2 * (w - 1) * n * 4 / w;
  std::string why;
  uint64_t sent = 0, received = 0, payload = 0;
  bool ok = wire_iteration(n, false, &sent, &received, &payload, &why);
  if (ok && (sent != ring || received != ring || payload != n * 4)) {
    ok = false;
    why = "sent " + std::to_string(sent) + ", received " + std::to_string(received) + ", payload " +
          std::to_string(payload) + "; the ring moves 2 (n - 1) / n x " + std::to_string(n * 4) + " = " +
          std::to_string(ring) + " each way, payload " + std::to_string(n * 4);
  }
  record("stats: bytes_sent and bytes_received are the ring's 2 (n - 1) / n of the bucket; bytes_reduced the payload",
         ok, why);
  if (DDP_TEST_NCCL) return;  // the bf16 hook converts on the host
  why.clear();
  uint64_t hsent = 0, hreceived = 0, hpayload = 0;
  ok = wire_iteration(n, true, &hsent, &hreceived, &hpayload, &why);
  // ddp_comm_allreduce first compares the ranks' arguments: a 16-byte record to every other rank.
  const uint64_t compare = 16 * static_cast<uint64_t>(g_world - 1);
  if (ok && (2 * (hsent - compare) != ring || 2 * (hreceived - compare) != ring || hpayload != n * 4)) {
    ok = false;
    why = "a hook sending bf16: sent " + std::to_string(hsent) + ", received " + std::to_string(hreceived) +
          ", payload " + std::to_string(hpayload) + "; wanted half the fp32 ring's " + std::to_string(ring) + " and " +
          std::to_string(compare) + " bytes of the arguments' comparison, and the payload " + std::to_string(n * 4);
  }
  record("stats: a hook that sends bf16 counts half the fp32 bytes and its comparison; bytes_reduced unchanged", ok,
         why);
}

}  // namespace

// Elastic contexts need a communicator that can be rebuilt: MPI (no ULFM) and NCCL refuse by name,
// on every rank alike (the config is agreed first, so no rank goes on alone); Gloo makes one.
void test_elastic_refused() {
  ddp_config_t cfg;
  ddp_config_init(&cfg);
  cfg.elastic = 1;
  ddp_t d = nullptr;
  std::string why;
  if (g_gloo) {  // Gloo is rebuilt: made
    const bool made = ddp_create(g_comm, &cfg, &d) == DDP_SUCCESS;
    if (!made) why = ddp_last_error();
    ddp_destroy(d);
    record("elastic: made over Gloo (it can be rebuilt)", made, why);
    return;
  }
  const bool ok =
      expect_status(ddp_create(g_comm, &cfg, &d), DDP_ERR_UNSUPPORTED, "MPI cannot shrink a communicator", &why) &&
      d == nullptr;
  record("elastic: refused by name over this communicator (it cannot be rebuilt)", ok, why);
}

int main(int argc, char** argv) {
  const char* label = start(&argc, &argv, "mpi-features", "mpi-nccl-features");
  test_elastic_refused();
  const uint64_t seed = shared_seed(argc, argv, 20261204);
  test_host_collectives(seed);
  test_join(seed + 1);
  test_compression(seed + 2);
  test_int8(seed + 4);
  test_int8_exact(seed + 5);
  test_hooks(seed + 3);
  test_wire_bytes();
  test_host_mismatch();
  test_argument_mismatch();
  return finish(label, seed);
}
