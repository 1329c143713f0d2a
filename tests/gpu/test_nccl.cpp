// The whole GPU path through the C API on a one-rank NCCL communicator (the collective still runs):
// copy and arena layouts, every dtype, 1 and 4 streams, the fused (ncclAvg, PreMulSum) and unfused
// (scaling folded into the kernels) paths, allreduce_always_fp32, moved grads, unused grads, bad device
// pointers, ordering against the caller's stream, check_finite, ddp_reduce_all and ddp_broadcast.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <string>

#include "gpu_test.hpp"

using gt::dsize;

namespace {

struct Nccl {
  ddp_comm_t comm = nullptr;
  Nccl() {
    ddp_nccl_id_t id;
    DDP_OK(ddp_nccl_get_unique_id(&id));
    DDP_OK(ddp_comm_init_nccl(&id, 1, 0, 0, &comm));
  }
  ~Nccl() { ddp_comm_destroy(comm); }
};

struct Grad {
  size_t numel;
  ddp_dtype_t dtype;
  void* ptr;
  std::vector<double> value;
};

// A mix of every dtype and of sizes around the bucket threshold.
std::vector<Grad> make_grads(std::mt19937_64& rng, bool all_dtypes) {
  std::vector<Grad> g;
  const size_t sizes[] = {1, 33, 1000, 4097, 20000, 3};
  for (int i = 0; i < 14; ++i) {
    ddp_dtype_t d = all_dtypes ? static_cast<ddp_dtype_t>(i % 4) : DDP_F32;
    g.push_back(Grad{sizes[static_cast<size_t>(i) % 6] + static_cast<size_t>(rng() % 5), d, nullptr, {}});
  }
  return g;
}

double scale_of(const ddp_config_t& c, int world) {
  return c.gradient_average ? 1.0 / world : 1.0 / c.gradient_predivide_factor;
}

// One backward: fresh values written on `stream` just before each grad is marked ready (so that a
// missing stream dependency shows), grads marked in a shuffled order, finish on the same stream.
void iterate(ddp_t ddp, std::vector<Grad>& g, std::mt19937_64& rng, cudaStream_t stream, bool arena,
             const std::vector<int>& skip = {}) {
  DDP_OK(ddp_begin_backward(ddp, stream));
  std::vector<int> order(g.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<std::vector<char>> staged(g.size());
  for (int i : order) {
    Grad& x = g[static_cast<size_t>(i)];
    if (arena) DDP_OK(ddp_grad_ptr(ddp, i, &x.ptr));
    x.value = gt::random_values(rng, x.numel, x.dtype);
    staged[static_cast<size_t>(i)] = gt::encode(x.value, x.dtype);
    CUDA_OK(cudaMemcpyAsync(x.ptr, staged[static_cast<size_t>(i)].data(), staged[static_cast<size_t>(i)].size(),
                            cudaMemcpyHostToDevice, stream));
    if (std::find(skip.begin(), skip.end(), i) != skip.end()) continue;
    DDP_OK(ddp_grad_ready(ddp, i));
  }
  ddp_status_t st = ddp_finish_backward(ddp, stream);
  if (skip.empty()) REQUIRE_MESSAGE(st == DDP_SUCCESS, ddp_last_error());
  CUDA_OK(cudaStreamSynchronize(stream));
}

size_t check_grads(ddp_t ddp, const std::vector<Grad>& g, double scale, bool arena, const std::vector<int>& zero = {}) {
  size_t bad = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    void* p = g[i].ptr;
    if (arena) REQUIRE(ddp_grad_ptr(ddp, static_cast<int>(i), &p) == DDP_SUCCESS);
    std::vector<double> want(g[i].value);
    const bool z = std::find(zero.begin(), zero.end(), static_cast<int>(i)) != zero.end();
    for (double& x : want) x = z ? 0.0 : x * scale;
    bad += gt::mismatches(gt::download(p, g[i].numel, g[i].dtype), want, g[i].dtype,
                          ("grad " + std::to_string(i)).c_str());
  }
  return bad;
}

void alloc_grads(std::vector<Grad>& g) {
  for (Grad& x : g) CUDA_OK(cudaMalloc(&x.ptr, x.numel * dsize(x.dtype)));
}
void free_grads(std::vector<Grad>& g) {
  for (Grad& x : g) cudaFree(x.ptr);
}
// Registers every grad (arena: storage from the library).
void register_all(ddp_t ddp, const std::vector<Grad>& g, bool arena) {
  for (const Grad& x : g) {
    int idx = -1;
    DDP_OK(ddp_register_grad(ddp, arena ? nullptr : x.ptr, x.numel, x.dtype, 0, &idx));
  }
}

// A context over `comm` with make_grads' grads registered (copy layout: device memory allocated here).
ddp_t context_with_grads(ddp_comm_t comm, const ddp_config_t& cfg, std::mt19937_64& rng, std::vector<Grad>* g) {
  ddp_t ddp = nullptr;
  DDP_OK(ddp_create(comm, &cfg, &ddp));
  *g = make_grads(rng, true);
  if (cfg.layout == DDP_LAYOUT_COPY) alloc_grads(*g);
  register_all(ddp, *g, cfg.layout == DDP_LAYOUT_ARENA);
  return ddp;
}

}  // namespace

GPU_TEST_CASE("nccl world 1: layouts x streams x scaling paths x plans, every dtype, float64 reference") {
  std::mt19937_64 rng(gt::seed() + 10);
  Nccl nc;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct Scaling {
    int average;
    double predivide;
    const char* path;
  };
  // With NCCL >= 2.11: Avg fused; PreMulSum fused and f/world folded into unpack; PreMulSum alone; plain sum.
  const Scaling scalings[] = {{1, 1.0, "avg"}, {1, 4.0, "premul + unpack scale"}, {0, 2.0, "premul"}, {0, 1.0, "sum"}};
  for (int arena = 0; arena < 2; ++arena) {
    for (int ns : {1, 4}) {
      for (const Scaling& sc : scalings) {
        for (int fp32 = 0; fp32 < 2; ++fp32) {
          CAPTURE(arena);
          CAPTURE(ns);
          CAPTURE(sc.path);
          CAPTURE(fp32);
          ddp_config_t cfg;
          DDP_OK(ddp_config_init(&cfg));
          cfg.layout = arena ? DDP_LAYOUT_ARENA : DDP_LAYOUT_COPY;
          cfg.plan_order = (ns + fp32) % 2 ? DDP_PLAN_REGISTRATION : DDP_PLAN_LEARNED;
          cfg.num_streams = ns;
          cfg.message_size = 5000;
          cfg.gradient_average = sc.average;
          cfg.gradient_predivide_factor = sc.predivide;
          cfg.allreduce_always_fp32 = fp32;
          cfg.timeout_ms = 60000;
          std::vector<Grad> g;
          ddp_t ddp = context_with_grads(nc.comm, cfg, rng, &g);
          // NCCL sums 16-bit types natively: they travel as themselves unless allreduce_always_fp32.
          int nb = 0;
          DDP_OK(ddp_get_plan(ddp, &nb, nullptr));
          for (int b = 0; b < nb; ++b) {
            ddp_bucket_info_t info;
            info.size = sizeof info;
            DDP_OK(ddp_get_bucket(ddp, b, &info, nullptr, 0));
            const bool is16 = info.dtype == DDP_F16 || info.dtype == DDP_BF16;
            CHECK(info.wire == (is16 && fp32 ? DDP_F32 : info.dtype));
            CHECK(info.stream == b % ns);
          }
          for (int it = 0; it < 3; ++it) {
            CAPTURE(it);
            iterate(ddp, g, rng, stream, arena != 0);
            CHECK(check_grads(ddp, g, scale_of(cfg, 1), arena != 0) == 0);
          }
          ddp_stats_t st;
          st.size = sizeof st;
          DDP_OK(ddp_get_stats(ddp, &st));
          CHECK(st.iterations == 3);
          CHECK(st.buckets_reduced >= 3 * 4);
          DDP_OK(ddp_destroy(ddp));
          if (!arena) free_grads(g);
        }
      }
    }
  }
  cudaStreamDestroy(stream);
}

// ddp_wait_grad before ddp_finish_backward: each grad read back on the caller's stream right after its
// wait must hold its reduced value (the stream waits for that bucket alone: later buckets are not
// waited for, and nothing but the wait orders the read after the bucket's work).
GPU_TEST_CASE("nccl world 1: ddp_wait_grad makes the caller's stream wait for the grad's bucket") {
  std::mt19937_64 rng(gt::seed() + 15);
  Nccl nc;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int arena = 0; arena < 2; ++arena)
    for (int ns : {1, 3}) {
      CAPTURE(arena);
      CAPTURE(ns);
      ddp_config_t cfg;
      DDP_OK(ddp_config_init(&cfg));
      cfg.plan_order = DDP_PLAN_REGISTRATION;  // the last grad's bucket first
      cfg.layout = arena ? DDP_LAYOUT_ARENA : DDP_LAYOUT_COPY;
      cfg.gradient_predivide_factor = 2.0;
      cfg.num_streams = ns;
      cfg.message_size = 5000;
      cfg.timeout_ms = 60000;
      std::vector<Grad> g;
      ddp_t ddp = context_with_grads(nc.comm, cfg, rng, &g);
      for (int it = 0; it < 2; ++it) {
        DDP_OK(ddp_begin_backward(ddp, stream));
        std::vector<std::vector<char>> staged(g.size()), back(g.size());
        for (size_t i = g.size(); i-- > 0;) {
          Grad& x = g[i];
          if (arena) DDP_OK(ddp_grad_ptr(ddp, static_cast<int>(i), &x.ptr));
          x.value = gt::random_values(rng, x.numel, x.dtype);
          staged[i] = gt::encode(x.value, x.dtype);
          CUDA_OK(cudaMemcpyAsync(x.ptr, staged[i].data(), staged[i].size(), cudaMemcpyHostToDevice, stream));
          DDP_OK(ddp_grad_ready(ddp, static_cast<int>(i)));
        }
        for (size_t i = g.size(); i-- > 0;) {
          int reduced = 0;
          DDP_OK(ddp_wait_grad(ddp, static_cast<int>(i), stream, &reduced));
          CHECK(reduced == 1);
          back[i].resize(staged[i].size());
          CUDA_OK(cudaMemcpyAsync(back[i].data(), g[i].ptr, back[i].size(), cudaMemcpyDeviceToHost, stream));
        }
        CUDA_OK(cudaStreamSynchronize(stream));
        size_t bad = 0;
        for (size_t i = 0; i < g.size(); ++i) {
          std::vector<double> want(g[i].value);
          for (double& x : want) x *= scale_of(cfg, 1);
          bad +=
              gt::mismatches(gt::decode(back[i], g[i].dtype), want, g[i].dtype, ("grad " + std::to_string(i)).c_str());
        }
        CHECK(bad == 0);
        DDP_OK(ddp_finish_backward(ddp, stream));
        CUDA_OK(cudaStreamSynchronize(stream));
      }
      DDP_OK(ddp_destroy(ddp));
      if (!arena) free_grads(g);
    }
  cudaStreamDestroy(stream);
}

GPU_TEST_CASE("nccl world 1: grads that move between iterations, in-place large grads, reduce_all") {
  std::mt19937_64 rng(gt::seed() + 11);
  Nccl nc;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ddp_config_t cfg;
  DDP_OK(ddp_config_init(&cfg));
  cfg.plan_order = DDP_PLAN_REGISTRATION;
  cfg.message_size = 30000;
  cfg.inplace_min_numel = 15000;  // the 20000-element grads are reduced in place, grouped with the bucket
  cfg.gradient_predivide_factor = 8.0;
  ddp_t ddp = nullptr;
  DDP_OK(ddp_create(nc.comm, &cfg, &ddp));
  std::vector<Grad> g = make_grads(rng, false);
  alloc_grads(g);
  register_all(ddp, g, false);
  iterate(ddp, g, rng, stream, false);
  CHECK(check_grads(ddp, g, 1.0, false) == 0);
  // PyTorch's set_to_none: every grad gets new storage.
  for (Grad& x : g) {
    void* old = x.ptr;
    CUDA_OK(cudaMalloc(&x.ptr, x.numel * dsize(x.dtype)));
    cudaFree(old);
  }
  DDP_OK(ddp_begin_backward(ddp, stream));
  for (size_t i = 0; i < g.size(); ++i) {
    g[i].value = gt::random_values(rng, g[i].numel, g[i].dtype);
    gt::upload(g[i].ptr, g[i].value, g[i].dtype, stream);
    DDP_OK(ddp_grad_ready_ptr(ddp, static_cast<int>(i), g[i].ptr));
  }
  DDP_OK(ddp_finish_backward(ddp, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  CHECK(check_grads(ddp, g, 1.0, false) == 0);
  // apex Reducer.reduce()
  for (Grad& x : g) {
    x.value = gt::random_values(rng, x.numel, x.dtype);
    gt::upload(x.ptr, x.value, x.dtype, stream);
  }
  DDP_OK(ddp_reduce_all(ddp, stream));
  DDP_OK(ddp_synchronize(ddp));
  CUDA_OK(cudaStreamSynchronize(stream));
  CHECK(check_grads(ddp, g, 1.0, false) == 0);
  DDP_OK(ddp_destroy(ddp));
  free_grads(g);
  cudaStreamDestroy(stream);
}

GPU_TEST_CASE("nccl world 1: unused grads, zero policy and error policy") {
  std::mt19937_64 rng(gt::seed() + 12);
  Nccl nc;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int policy : {DDP_UNUSED_ZERO, DDP_UNUSED_ERROR}) {
    for (int arena = 0; arena < 2; ++arena) {
      CAPTURE(policy);
      CAPTURE(arena);
      ddp_config_t cfg;
      DDP_OK(ddp_config_init(&cfg));
      cfg.unused_policy = policy;
      cfg.layout = arena ? DDP_LAYOUT_ARENA : DDP_LAYOUT_COPY;
      cfg.plan_order = DDP_PLAN_REGISTRATION;
      cfg.message_size = 3000;
      ddp_t ddp = nullptr;
      DDP_OK(ddp_create(nc.comm, &cfg, &ddp));
      std::vector<Grad> g = make_grads(rng, true);
      if (!arena) alloc_grads(g);
      register_all(ddp, g, arena != 0);
      const std::vector<int> skip = {2, 9};
      iterate(ddp, g, rng, stream, arena != 0, skip);
      // Whatever the policy, the skipped grads were reduced as zeros.
      CHECK(check_grads(ddp, g, 1.0, arena != 0, skip) == 0);
      // Next iteration: everything ready again, the zero flags are cleared.
      iterate(ddp, g, rng, stream, arena != 0);
      CHECK(check_grads(ddp, g, 1.0, arena != 0) == 0);
      DDP_OK(ddp_destroy(ddp));
      if (!arena) free_grads(g);
    }
  }
  // The error policy's status and message.
  ddp_config_t cfg;
  DDP_OK(ddp_config_init(&cfg));
  ddp_t ddp = nullptr;
  DDP_OK(ddp_create(nc.comm, &cfg, &ddp));
  void* a = nullptr;
  void* b = nullptr;
  CUDA_OK(cudaMalloc(&a, 4096));
  CUDA_OK(cudaMalloc(&b, 4096));
  int ia, ib;
  DDP_OK(ddp_register_grad(ddp, a, 1024, DDP_F32, 0, &ia));
  DDP_OK(ddp_register_grad(ddp, b, 1024, DDP_F32, 0, &ib));
  DDP_OK(ddp_begin_backward(ddp, stream));
  DDP_OK(ddp_grad_ready(ddp, ia));
  CHECK(ddp_finish_backward(ddp, stream) == DDP_ERR_INVALID_STATE);
  CHECK(std::string(ddp_last_error()).find("rank 0: grad 1") != std::string::npos);
  DDP_OK(ddp_destroy(ddp));
  cudaFree(a);
  cudaFree(b);
  cudaStreamDestroy(stream);
}

GPU_TEST_CASE("nccl world 1: a host pointer registered as a grad fails cleanly, then the context is aborted") {
  Nccl nc;
  ddp_config_t cfg;
  DDP_OK(ddp_config_init(&cfg));
  cfg.plan_order = DDP_PLAN_REGISTRATION;
  ddp_t ddp = nullptr;
  DDP_OK(ddp_create(nc.comm, &cfg, &ddp));
  std::vector<float> host(4096, 1.0f);
  void* dev = nullptr;
  CUDA_OK(cudaMalloc(&dev, 4096 * 4));
  int i0, i1;
  DDP_OK(ddp_register_grad(ddp, dev, 4096, DDP_F32, 0, &i0));
  DDP_OK(ddp_register_grad(ddp, host.data(), 4096, DDP_F32, 0, &i1));
  DDP_OK(ddp_begin_backward(ddp, nullptr));
  DDP_OK(ddp_grad_ready(ddp, i0));
  ddp_status_t st = ddp_grad_ready(ddp, i1);  // completes the bucket: its launch finds the host pointer
  CHECK(st == DDP_ERR_CUDA);
  CHECK(std::string(ddp_last_error()).find("not memory CUDA device") != std::string::npos);
  CHECK(ddp_finish_backward(ddp, nullptr) == DDP_ERR_ABORTED);
  CHECK(cudaDeviceSynchronize() == cudaSuccess);  // nothing faulted on the device
  DDP_OK(ddp_destroy(ddp));
  cudaFree(dev);
}

GPU_TEST_CASE("nccl world 1: check_finite counts buckets with NaN, and ddp_broadcast keeps root's values") {
  std::mt19937_64 rng(gt::seed() + 13);
  Nccl nc;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ddp_config_t cfg;
  DDP_OK(ddp_config_init(&cfg));
  cfg.check_finite = 1;
  cfg.plan_order = DDP_PLAN_REGISTRATION;
  cfg.message_size = 1000;
  ddp_t ddp = nullptr;
  DDP_OK(ddp_create(nc.comm, &cfg, &ddp));
  std::vector<Grad> g(3, Grad{1000, DDP_F32, nullptr, {}});
  alloc_grads(g);
  register_all(ddp, g, false);
  DDP_OK(ddp_begin_backward(ddp, stream));
  for (size_t i = 0; i < g.size(); ++i) {
    g[i].value = gt::random_values(rng, g[i].numel, g[i].dtype);
    if (i == 1) g[i].value[17] = std::nan("");
    gt::upload(g[i].ptr, g[i].value, g[i].dtype, stream);
    DDP_OK(ddp_grad_ready(ddp, static_cast<int>(i)));
  }
  DDP_OK(ddp_finish_backward(ddp, stream));
  DDP_OK(ddp_synchronize(ddp));
  ddp_stats_t st;
  st.size = sizeof st;
  DDP_OK(ddp_get_stats(ddp, &st));
  CHECK(st.nonfinite_buckets == 1);

  std::vector<double> v = gt::random_values(rng, 777, DDP_BF16);
  void* buf = nullptr;
  CUDA_OK(cudaMalloc(&buf, 777 * 2));
  gt::upload(buf, v, DDP_BF16);
  void* bufs[] = {buf};
  size_t counts[] = {777};
  ddp_dtype_t types[] = {DDP_BF16};
  DDP_OK(ddp_broadcast(ddp, bufs, counts, types, 1, 0, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  CHECK(gt::mismatches(gt::download(buf, 777, DDP_BF16), v, DDP_F64, "broadcast") == 0);
  CHECK(ddp_broadcast(ddp, bufs, counts, types, 1, 1, stream) == DDP_ERR_INVALID_ARGUMENT);
  cudaFree(buf);
  DDP_OK(ddp_destroy(ddp));
  free_grads(g);
  cudaStreamDestroy(stream);
}

GPU_TEST_CASE("nccl: wrapped communicators are borrowed, and bad arguments are refused") {
  Nccl nc;
  ddp_comm_t wrapped = nullptr;
  // A comm made by libddp cannot be unwrapped from the C API; the id path covers ncclCommInitRank and
  // the context's duplicates cover ncclCommSplit. Here: argument checks of the NCCL entry points.
  CHECK(ddp_comm_wrap_nccl(nullptr, &wrapped) == DDP_ERR_INVALID_ARGUMENT);
  ddp_nccl_id_t id;
  DDP_OK(ddp_nccl_get_unique_id(&id));
  ddp_comm_t c = nullptr;
  CHECK(ddp_comm_init_nccl(&id, 1, 0, 4096, &c) == DDP_ERR_INVALID_ARGUMENT);
  CHECK(std::string(ddp_last_error()).find("does not exist") != std::string::npos);
  CHECK(c == nullptr);
  int rank = -1, size = -1;
  DDP_OK(ddp_comm_rank(nc.comm, &rank));
  DDP_OK(ddp_comm_size(nc.comm, &size));
  CHECK(rank == 0);
  CHECK(size == 1);
}

GPU_TEST_CASE("nccl: a wrapped ncclComm_t is used through split communicators and never destroyed") {
  std::mt19937_64 rng(gt::seed() + 14);
  ncclComm_t raw = nullptr;
  int devs[] = {0};
  REQUIRE(ncclCommInitAll(&raw, 1, devs) == ncclSuccess);
  ddp_comm_t wrapped = nullptr;
  DDP_OK(ddp_comm_wrap_nccl(raw, &wrapped));
  ddp_config_t cfg;
  DDP_OK(ddp_config_init(&cfg));
  cfg.num_streams = 2;
  cfg.message_size = 2000;
  cfg.plan_order = DDP_PLAN_REGISTRATION;
  ddp_t ddp = nullptr;
  DDP_OK(ddp_create(wrapped, &cfg, &ddp));
  std::vector<Grad> g = make_grads(rng, true);
  alloc_grads(g);
  register_all(ddp, g, false);
  iterate(ddp, g, rng, nullptr, false);
  CHECK(check_grads(ddp, g, 1.0, false) == 0);
  DDP_OK(ddp_destroy(ddp));
  DDP_OK(ddp_comm_destroy(wrapped));
  int count = 0;
  CHECK(ncclCommCount(raw, &count) == ncclSuccess);  // still alive: borrowed, not destroyed
  CHECK(count == 1);
  CHECK(ncclCommDestroy(raw) == ncclSuccess);
  free_grads(g);
}

GPU_TEST_CASE("nccl: creation is bounded: a rank that never joins costs the timeout, then DDP_ERR_TIMEOUT") {
  int version = 0;
  REQUIRE(ncclGetVersion(&version) == ncclSuccess);
  if (version < 21400) {
    MESSAGE("NCCL " << version << " has no nonblocking creation: ddp_comm_init_nccl blocks (documented)");
    return;
  }
  ddp_nccl_id_t id;
  DDP_OK(ddp_nccl_get_unique_id(&id));
  ddp_comm_t comm = nullptr;
  const auto t0 = std::chrono::steady_clock::now();
  // Rank 0 of 2; rank 1 never comes.
  ddp_status_t st = ddp_comm_init_nccl_timeout(&id, 2, 0, 0, 500, &comm);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  CHECK(st == DDP_ERR_TIMEOUT);
  CHECK(comm == nullptr);
  const std::string msg = ddp_last_error();
  CHECK(msg.find("rank 0 of 2") != std::string::npos);
  CHECK(msg.find("not created within 500 ms") != std::string::npos);
  CHECK(ms >= 450);
  CHECK(ms < 500 + 1000);
  CHECK(ddp_comm_init_nccl_timeout(&id, 1, 0, 0, -1, &comm) == DDP_ERR_INVALID_ARGUMENT);
  CHECK(std::string(ddp_last_error()).find("timeout_ms is -1") != std::string::npos);

  // A communicator made with a bound works, duplicates included (a context holds one).
  DDP_OK(ddp_nccl_get_unique_id(&id));
  DDP_OK(ddp_comm_init_nccl_timeout(&id, 1, 0, 0, 10000, &comm));
  ddp_config_t cfg;
  DDP_OK(ddp_config_init(&cfg));
  ddp_t ddp = nullptr;
  DDP_OK(ddp_create(comm, &cfg, &ddp));
  void* grad = nullptr;
  CUDA_OK(cudaMalloc(&grad, 1000 * sizeof(float)));
  std::vector<float> host(1000, 3.0f);
  CUDA_OK(cudaMemcpy(grad, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  int index = -1;
  DDP_OK(ddp_register_grad(ddp, grad, 1000, DDP_F32, 0, &index));
  DDP_OK(ddp_begin_backward(ddp, nullptr));
  DDP_OK(ddp_grad_ready(ddp, index));
  DDP_OK(ddp_finish_backward(ddp, nullptr));
  DDP_OK(ddp_synchronize(ddp));
  CUDA_OK(cudaMemcpy(host.data(), grad, host.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK(host[0] == 3.0f);
  CHECK(host[999] == 3.0f);
  DDP_OK(ddp_destroy(ddp));
  DDP_OK(ddp_comm_destroy(comm));
  CUDA_OK(cudaFree(grad));
}

GPU_TEST_CASE("nccl world 1: a sharded context reduce-scatters, gathers on the stream and takes the norm") {
  std::mt19937_64 rng(gt::seed() + 41);
  Nccl n;
  // A non-blocking stream is not ordered after the legacy stream: the grads' and parameters' new
  // storage must be zeroed before the library hands it out, not by a memset still queued there.
  for (int fp32 = 0; fp32 < 2; ++fp32)
    for (double pre : {1.0, 3.0})
      for (unsigned flags : {cudaStreamDefault, cudaStreamNonBlocking}) {
        CAPTURE(fp32);
        CAPTURE(pre);
        CAPTURE(flags);
        ddp_config_t cfg;
        DDP_OK(ddp_config_init(&cfg));
        cfg.layout = DDP_LAYOUT_ARENA;
        cfg.plan_order = DDP_PLAN_REGISTRATION;
        cfg.shard = 1;
        cfg.message_size = 3000;
        cfg.num_streams = 2;
        cfg.allreduce_always_fp32 = fp32;
        cfg.gradient_predivide_factor = pre;
        cfg.gradient_average = 0;
        ddp_t ddp = nullptr;
        DDP_OK(ddp_create(n.comm, &cfg, &ddp));
        std::vector<Grad> g = make_grads(rng, true);
        register_all(ddp, g, true);
        cudaStream_t stream;
        CUDA_OK(cudaStreamCreateWithFlags(&stream, flags));
        iterate(ddp, g, rng, stream, true);
        CHECK(check_grads(ddp, g, scale_of(cfg, 1), true) == 0);  // one rank: the shard is the whole bucket
        // The norm: the squares of what the grads now hold, in float64.
        double want = 0;
        for (size_t i = 0; i < g.size(); ++i) {
          void* p = nullptr;
          DDP_OK(ddp_grad_ptr(ddp, static_cast<int>(i), &p));
          for (double v : gt::download(p, g[i].numel, g[i].dtype)) want += v * v;
        }
        double norm = 0;
        uint64_t bad = 9;
        DDP_OK(ddp_shard_norm(ddp, stream, &norm, &bad));
        CHECK(norm == doctest::Approx(std::sqrt(want)).epsilon(1e-12));
        CHECK(bad == 0);
        // Parameters: write this rank's shards on the stream, gather, wait on the stream, read back.
        int nb = 0;
        DDP_OK(ddp_get_plan(ddp, &nb, nullptr));
        std::vector<std::vector<char>> staged(static_cast<size_t>(nb));
        for (int b = 0; b < nb; ++b) {
          ddp_shard_info_t s;
          s.size = sizeof s;
          DDP_OK(ddp_get_shard(ddp, b, &s));
          std::vector<double> v(s.shard_numel);
          for (size_t k = 0; k < v.size(); ++k) v[k] = static_cast<double>(b * 16 + static_cast<int>(k % 16));
          staged[static_cast<size_t>(b)] = gt::encode(v, s.dtype);
          CUDA_OK(cudaMemcpyAsync(s.param_shard, staged[static_cast<size_t>(b)].data(),
                                  staged[static_cast<size_t>(b)].size(), cudaMemcpyHostToDevice, stream));
        }
        DDP_OK(ddp_gather_params(ddp, stream));
        DDP_OK(ddp_wait_params(ddp, 0, stream));
        DDP_OK(ddp_wait_params(ddp, -1, stream));
        CUDA_OK(cudaStreamSynchronize(stream));
        for (int b = 0; b < nb; ++b) {
          ddp_shard_info_t s;
          s.size = sizeof s;
          DDP_OK(ddp_get_shard(ddp, b, &s));
          std::vector<double> got = gt::download(s.param_shard, s.shard_numel, s.dtype);
          size_t wrong = 0;
          for (size_t k = 0; k < got.size(); ++k)
            wrong += got[k] != static_cast<double>(b * 16 + static_cast<int>(k % 16));
          CHECK(wrong == 0);
        }
        CHECK(ddp_gather_params(ddp, stream) == DDP_ERR_INVALID_STATE);
        DDP_OK(ddp_destroy(ddp));
        CUDA_OK(cudaStreamDestroy(stream));
      }
}

// The caller's pending CUDA error (one it has not read with cudaGetLastError yet) is still there after
// libddp's calls: the kernels report their own launch results, and CUB's batched copy, which answers
// the thread's last error after its launch, is left aside while one is pending. Plain copies (CUB) and
// a scaled unflatten (the multi-tensor kernel), every result checked.
GPU_TEST_CASE("nccl world 1: an error the caller has not read yet survives libddp's launches") {
  Nccl nc;
  int ndev = 0;
  CUDA_OK(cudaGetDeviceCount(&ndev));
  for (int scaled = 0; scaled < 2; ++scaled) {
    CAPTURE(scaled);
    ddp_config_t cfg;
    DDP_OK(ddp_config_init(&cfg));
    cfg.plan_order = DDP_PLAN_REGISTRATION;
    cfg.message_size = 4096;
    cfg.gradient_predivide_factor = scaled ? 2.0 : 1.0;  // average: x 1/2 fused, x 2 folded into unflatten
    ddp_t ddp = nullptr;
    DDP_OK(ddp_create(nc.comm, &cfg, &ddp));
    std::vector<void*> grads(3, nullptr);
    std::vector<int> index(3, -1);
    for (size_t i = 0; i < grads.size(); ++i) {
      CUDA_OK(cudaMalloc(&grads[i], 1000 * sizeof(float)));
      DDP_OK(ddp_register_grad(ddp, grads[i], 1000, DDP_F32, 0, &index[i]));
    }
    for (int it = 0; it < 3; ++it) {  // the first uploads the tables; the pending error is set before the others
      std::vector<float> host(1000);
      for (size_t i = 0; i < grads.size(); ++i) {
        for (size_t k = 0; k < host.size(); ++k) host[k] = static_cast<float>(it * 1000 + i * 10 + k % 7);
        CUDA_OK(cudaMemcpy(grads[i], host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
      }
      if (it > 0) CHECK(cudaSetDevice(ndev) == cudaErrorInvalidDevice);  // now pending
      DDP_OK(ddp_begin_backward(ddp, nullptr));
      for (int k : index) DDP_OK(ddp_grad_ready(ddp, k));
      DDP_OK(ddp_finish_backward(ddp, nullptr));
      DDP_OK(ddp_synchronize(ddp));
      if (it > 0) CHECK(cudaGetLastError() == cudaErrorInvalidDevice);
      CHECK(cudaGetLastError() == cudaSuccess);
      for (size_t i = 0; i < grads.size(); ++i) {
        CUDA_OK(cudaMemcpy(host.data(), grads[i], host.size() * sizeof(float), cudaMemcpyDeviceToHost));
        for (size_t k = 0; k < host.size(); ++k)
          if (host[k] != static_cast<float>(it * 1000 + i * 10 + k % 7)) {
            FAIL_CHECK("iteration " << it << ", grad " << i << "[" << k << "] = " << host[k]);
            break;
          }
      }
    }
    DDP_OK(ddp_destroy(ddp));
    for (void* g : grads) CUDA_OK(cudaFree(g));
  }
}
