// What the multi-rank test programs share: the rank and world, grad memory (host memory on MPI,
// device memory on NCCL, with copies in and out), and a record of results that passes a test only if
// it passed on every rank.
#pragma once

#include <mpi.h>
#ifndef DDP_TEST_NCCL
#define DDP_TEST_NCCL 0
#endif
#if DDP_TEST_NCCL
#include <cuda_runtime_api.h>
#endif

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ddp.h"

namespace {

int g_rank = 0, g_world = 1;
ddp_comm_t g_comm = nullptr;
int g_passed = 0, g_failed = 0;

// Grad storage: host memory on MPI, device memory on NCCL, and the copies in and out.
inline void* grad_alloc(size_t bytes) {
#if DDP_TEST_NCCL
  void* p = nullptr;
  if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess || cudaMemset(p, 0, bytes ? bytes : 1) != cudaSuccess) {
    std::fprintf(stderr, "cudaMalloc of %zu bytes failed\n", bytes);
    std::abort();
  }
  return p;
#else
  return std::calloc(1, bytes ? bytes : 1);
#endif
}
inline void grad_free(void* p) {
#if DDP_TEST_NCCL
  cudaFree(p);
#else
  std::free(p);
#endif
}
inline void grad_write(void* dst, const std::vector<char>& host) {
#if DDP_TEST_NCCL
  if (cudaMemcpy(dst, host.data(), host.size(), cudaMemcpyHostToDevice) != cudaSuccess) std::abort();
#else
  std::memcpy(dst, host.data(), host.size());
#endif
}
inline std::vector<char> grad_read(const void* src, size_t bytes) {
  std::vector<char> host(bytes);
#if DDP_TEST_NCCL
  if (cudaMemcpy(host.data(), src, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) std::abort();
#else
  std::memcpy(host.data(), src, bytes);
#endif
  return host;
}

// A test passes only if it passed on every rank.
inline void record(const std::string& name, bool ok_here, const std::string& why) {
  int ok = ok_here ? 1 : 0, all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!ok_here) std::fprintf(stderr, "[rank %d] FAIL %s: %s\n", g_rank, name.c_str(), why.c_str());
  if (all)
    ++g_passed;
  else
    ++g_failed;
  if (!all && g_rank == 0) std::fprintf(stderr, "FAIL %s\n", name.c_str());
}

// A call that must succeed, inside a function that returns false with *why set.
#define EXPECT_OK(call)                                                                      \
  do {                                                                                       \
    ddp_status_t st_ = (call);                                                               \
    if (st_ != DDP_SUCCESS) {                                                                \
      *why = std::string(#call) + " -> " + ddp_status_string(st_) + ": " + ddp_last_error(); \
      return false;                                                                          \
    }                                                                                        \
  } while (0)

inline bool expect_status(ddp_status_t got, ddp_status_t want, const char* needle, std::string* why) {
  if (got != want) {
    *why = std::string("status ") + ddp_status_string(got) + ", wanted " + ddp_status_string(want) + " (" +
           ddp_last_error() + ")";
    return false;
  }
  if (needle && !std::strstr(ddp_last_error(), needle)) {
    *why = std::string("message lacks '") + needle + "': " + ddp_last_error();
    return false;
  }
  return true;
}

// Whether the communicator under test is Gloo's (DDP_TEST_GLOO; never in the NCCL build, whose programs
// may not read it).
[[maybe_unused]] bool g_gloo = false;

// Destroys a context when a test returns early.
struct Closer {
  ddp_t d;
  ~Closer() { ddp_destroy(d); }
};

// MPI, the rank and world, the communicator the tests run over (NCCL made over MPI in the NCCL
// build, one device per rank); returns the label of the summary line.
inline const char* start(int* argc, char*** argv, const char* mpi_label, const char* nccl_label) {
  int provided = 0;
  MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_world);
  MPI_Comm world = MPI_COMM_WORLD;
#if DDP_TEST_NCCL
  int ndev = 0;
  cudaGetDeviceCount(&ndev);
  const int device = ndev > 0 ? g_rank % ndev : 0;
  cudaSetDevice(device);
  const char* label = nccl_label;
  const ddp_status_t st = ddp_comm_init_nccl_mpi(&world, device, &g_comm);
#else
  const char* label = mpi_label;
  ddp_status_t st;
  // DDP_TEST_GLOO=tcp://HOST:PORT runs the same cases over Gloo (MPI then only starts the ranks and
  // checks the results).
  if (const char* gloo = std::getenv("DDP_TEST_GLOO")) {
    g_gloo = true;
    static const std::string gloo_label = "gloo" + std::string(mpi_label).substr(3);  // mpi-shard: gloo-shard
    label = gloo_label.c_str();
    st = ddp_comm_init_gloo(gloo, g_rank, g_world, &g_comm);
  } else {
    st = ddp_comm_init_mpi(&world, &g_comm);
  }
#endif
  if (st != DDP_SUCCESS) {
    std::fprintf(stderr, "making the communicator: %s\n", ddp_last_error());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  return label;
}

// The seed every rank uses: rank 0's (its argument, or `fallback`).
inline uint64_t shared_seed(int argc, char** argv, uint64_t fallback) {
  uint64_t seed = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : fallback;
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  return seed;
}

// Rank 0's summary line; the exit status.
inline int finish(const char* label, uint64_t seed) {
  ddp_comm_destroy(g_comm);
  if (g_rank == 0)
    std::printf("%s(np=%d, seed=%llu): %d passed, %d failed\n", label, g_world, static_cast<unsigned long long>(seed),
                g_passed, g_failed);
  MPI_Finalize();
  return g_failed ? 1 : 0;
}

}  // namespace
