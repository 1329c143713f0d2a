// Multi-rank tests of what a trainer asks for beyond the backward pass, under mpirun (or over Gloo
// with DDP_TEST_GLOO): uneven inputs (ddp_join, random batch counts per rank, both divisors), the
// 16-bit wire (config.compression), host collectives (ddp_allreduce_host, ddp_barrier) and comm
// hooks (ddp_set_comm_hook with ddp_comm_allreduce). Values are checked against a float64 reference
// built from every rank's deterministic inputs; reduced values are bitwise the same on every rank.
// Rank 0 prints "mpi-features(np=N): P passed, F failed" (gloo-features over Gloo).
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ddp.h"
#include "harness.hpp"
#include "reference.hpp"

namespace {

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
  float one = 1.0f;
  int index = -1;
  why.clear();
  ok = ddp_register_grad(d, &one, 1, DDP_F32, 0, &index) == DDP_SUCCESS && ddp_commit(d) == DDP_SUCCESS &&
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

// Ranks that call different things fail together: sizes that differ, and a barrier against an
// allreduce. (Last: the context is aborted afterwards.)
void test_host_mismatch() {
  if (g_world < 2) return;
  for (int kind = 0; kind < 2; ++kind) {
    ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
    cfg.timeout_ms = 30000;
    ddp_t d = nullptr;
    std::string why;
    if (ddp_create(g_comm, &cfg, &d) != DDP_SUCCESS) {
      record("host mismatch: ddp_create", false, ddp_last_error());
      continue;
    }
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

// --- grads: shared helpers -----------------------------------------------------------------------

struct Layout {
  int arena, plan;
};

struct Model {
  std::vector<size_t> numel;
  std::vector<ddp_dtype_t> dtype;
  std::vector<std::vector<char>> copy;  // copy layout: the grads' storage
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
  m.copy.resize(m.numel.size());
  m.index.resize(m.numel.size());
  for (size_t g = 0; g < m.numel.size(); ++g) {
    void* p = nullptr;
    if (!arena) {
      m.copy[g].assign(m.numel[g] * ref::dsize(m.dtype[g]), 0);
      p = m.copy[g].data();
    }
    EXPECT_OK(ddp_register_grad(d, p, m.numel[g], m.dtype[g], 0, &m.index[g]));
  }
  EXPECT_OK(ddp_commit(d));
  return true;
}

void* grad_of(ddp_t d, Model& m, size_t g, bool arena) {
  if (!arena) return m.copy[g].data();
  void* p = nullptr;
  ddp_grad_ptr(d, m.index[g], &p);
  return p;
}

// Writes this rank's grads of iteration `it` and runs one backward pass, marking them in an order of
// this rank's own.
bool backward(ddp_t d, Model& m, bool arena, uint64_t seed, int it, std::mt19937_64& mine, std::string* why) {
  std::vector<size_t> order(m.numel.size());
  for (size_t g = 0; g < order.size(); ++g) {
    order[g] = g;
    void* p = grad_of(d, m, g, arena);
    for (size_t i = 0; i < m.numel[g]; ++i)
      ref::store(p, i, m.dtype[g], ref::quantize(ref::raw_value(seed, g_rank, it, static_cast<int>(g), i), m.dtype[g]));
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
    const char* p = static_cast<const char*>(grad_of(d, m, g, arena));
    out.insert(out.end(), p, p + m.numel[g] * ref::dsize(m.dtype[g]));
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
      const void* p = grad_of(d, m, g, l.arena);
      for (size_t i = 0; i < m.numel[g]; ++i) {
        const Sum sum = reference_sum(seed, it, g, i, m.dtype[g], &batches);
        const double want = sum.want * scale, mag = sum.mag;
        const double got = ref::load(p, i, m.dtype[g]);
        if (!ref::close(got, want, mag * scale, m.dtype[g])) {
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
    const void* p = grad_of(d, m, g, l.arena);
    const Sum sum = reference_sum(seed, 77, g, 0, m.dtype[g], nullptr);
    if (!ref::close(ref::load(p, 0, m.dtype[g]), sum.want / g_world, sum.mag / g_world, m.dtype[g])) {
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

bool compression_case(const Layout& l, int compression, uint64_t seed, uint64_t* bytes, std::string* why) {
  std::mt19937_64 shared(seed), mine(seed * 5 + static_cast<uint64_t>(g_rank));
  Model m = make_model(shared, true, shared() % 2 == 0);
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.layout = l.arena;
  cfg.plan_order = l.plan;
  cfg.message_size = 1 + shared() % 200000;
  cfg.compression = compression;
  cfg.gradient_predivide_factor = shared() % 2 ? 1.0 : 3.0;
  cfg.timeout_ms = 30000;
  ddp_t d = nullptr;
  EXPECT_OK(ddp_create(g_comm, &cfg, &d));
  const Closer closer{d};
  if (!register_model(d, m, l.arena, why)) return false;
  // The bound of the documentation: an input rounding, one per hop, one for the result (and the
  // pre-division in 16-bit math), each relative 2^-8 (bf16) or 2^-11 (fp16) of the magnitudes summed.
  const double u = compression == DDP_COMPRESS_BF16 ? 1.0 / 256 : 1.0 / 2048;
  const double bound = (g_world + 3) * u;
  // fp16 has subnormals below 2^-14: there its absolute step, 2^-24, is what a rounding costs (times
  // the pre-division factor, up to 3, and the roundings counted above).
  const double floor = compression == DDP_COMPRESS_FP16 ? (g_world + 3) * 3.0 * std::ldexp(1.0, -24) : 0.0;
  for (int it = 0; it < 3; ++it) {
    if (!backward(d, m, l.arena, seed, it, mine, why)) return false;
    for (size_t g = 0; g < m.numel.size(); ++g) {
      const void* p = grad_of(d, m, g, l.arena);
      for (size_t i = 0; i < m.numel[g]; ++i) {
        const Sum sum = reference_sum(seed, it, g, i, m.dtype[g], nullptr);
        const double want = sum.want / g_world, mag = sum.mag / g_world;
        const double got = ref::load(p, i, m.dtype[g]);
        if (!(std::fabs(got - want) <= bound * mag + floor + 1e-30)) {
          *why = "iteration " + std::to_string(it) + ", grad " + std::to_string(g) + "[" + std::to_string(i) +
                 "]: " + std::to_string(got) + ", want " + std::to_string(want) + " within " +
                 std::to_string(bound * mag + floor);
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
      for (int comp : {DDP_COMPRESS_BF16, DDP_COMPRESS_FP16}) {
        std::string why;
        const uint64_t s = seed + static_cast<uint64_t>(++n) * 313;
        uint64_t packed = 0, plain = 0;
        bool ok = compression_case(Layout{arena, plan}, comp, s, &packed, &why);
        // The same model uncompressed: the wire carries twice the bytes for f32, four times for f64.
        if (ok) ok = compression_case(Layout{arena, plan}, DDP_COMPRESS_NONE, s, &plain, &why);
        if (ok && !(packed * 2 <= plain && packed * 4 >= plain)) {
          ok = false;
          why = "bytes reduced: " + std::to_string(packed) + " compressed, " + std::to_string(plain) + " not";
        }
        record(std::string("compression: ") + (comp == DDP_COMPRESS_BF16 ? "bf16" : "fp16") +
                   (arena ? " arena" : " copy") + (plan ? " registration" : " learned"),
               ok, why);
      }
}

// --- comm hooks ------------------------------------------------------------------------------------

struct HookLog {
  int calls = 0;
  int fail_at = -1;  // the call that returns an error
  size_t elements = 0;
};

ddp_status_t summing_hook(const ddp_hook_bucket_t* b, void* user) {
  HookLog* log = static_cast<HookLog*>(user);
  if (log->calls++ == log->fail_at) return DDP_ERR_INVALID_ARGUMENT;
  log->elements += b->count;
  if (b->size < sizeof(ddp_hook_bucket_t) || b->world != g_world || b->rank != g_rank) return DDP_ERR_INTERNAL;
  return ddp_comm_allreduce(b->comm, b->buffer, b->count, b->dtype, DDP_OP_SUM, b->stream);
}

bool hook_case(const Layout& l, uint64_t seed, std::string* why) {
  std::mt19937_64 shared(seed), mine(seed * 3 + static_cast<uint64_t>(g_rank));
  Model m = make_model(shared, false, false);
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  cfg.layout = l.arena;
  cfg.plan_order = l.plan;
  cfg.message_size = 1 + shared() % 4000;
  cfg.num_streams = 1 + static_cast<int>(shared() % 2);
  cfg.gradient_predivide_factor = shared() % 2 ? 1.0 : 2.0;
  cfg.timeout_ms = 30000;
  ddp_t d = nullptr;
  EXPECT_OK(ddp_create(g_comm, &cfg, &d));
  const Closer closer{d};
  HookLog log;
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
      const void* p = grad_of(d, m, g, l.arena);
      for (size_t i = 0; i < m.numel[g]; ++i) {
        const Sum sum = reference_sum(seed, it, g, i, m.dtype[g], nullptr);
        // 16-bit grads: the hook gets them as the library would send them (fp32 on host comms).
        if (!ref::close(ref::load(p, i, m.dtype[g]), sum.want / g_world, sum.mag / g_world, m.dtype[g])) {
          *why = "iteration " + std::to_string(it) + ", grad " + std::to_string(g) + ": not the average";
          return false;
        }
      }
    }
    if (!same_everywhere(all_bytes(d, m, l.arena), why, "reduced grads")) return false;
  }
  return true;
}

void test_hooks(uint64_t seed) {
  int n = 0;
  for (int arena = 0; arena < 2; ++arena)
    for (int plan = 0; plan < 2; ++plan) {
      std::string why;
      const bool ok = hook_case(Layout{arena, plan}, seed + static_cast<uint64_t>(++n) * 577, &why);
      record(std::string("hook: summing over ddp_comm_allreduce, ") + (arena ? "arena" : "copy") +
                 (plan ? " registration" : " learned"),
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
    std::vector<float> a(20, 1.0f), b(20, 1.0f);
    int ia = 0, ib = 0;
    bool ok = ddp_create(g_comm, &cfg, &d) == DDP_SUCCESS && ddp_set_comm_hook(d, summing_hook, &log) == DDP_SUCCESS &&
              ddp_register_grad(d, a.data(), a.size(), DDP_F32, 0, &ia) == DDP_SUCCESS &&
              ddp_register_grad(d, b.data(), b.size(), DDP_F32, 0, &ib) == DDP_SUCCESS &&
              ddp_begin_backward(d, nullptr) == DDP_SUCCESS && ddp_grad_ready(d, ib) == DDP_SUCCESS &&
              ddp_grad_ready(d, ia) == DDP_SUCCESS;
    ok = ok &&
         expect_status(ddp_finish_backward(d, nullptr), DDP_ERR_ABORTED,
                       "comm hook returned 1 (invalid argument) for bucket 1", &why) &&
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
    // Outside a hook, on a host comm: an ordinary collective.
    float y[3] = {1.0f * static_cast<float>(g_rank), 1, 2};
    ok = ok && ddp_comm_allreduce(g_comm, y, 3, DDP_F32, DDP_OP_AVG, nullptr) == DDP_SUCCESS &&
         y[0] == static_cast<float>(g_world - 1) / 2.0f && y[1] == 1.0f && y[2] == 2.0f;
    if (!ok && why.empty()) why = std::string("ddp_comm_allreduce average: ") + ddp_last_error();
    record("hook: misuse refused; ddp_comm_allreduce outside a hook", ok, why);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const char* label = start(&argc, &argv, "mpi-features", "nccl-features");
  const uint64_t seed = shared_seed(argc, argv, 20261204);
  test_host_collectives(seed);
  test_join(seed + 1);
  test_compression(seed + 2);
  test_hooks(seed + 3);
  test_host_mismatch();
  return finish(label, seed);
}
