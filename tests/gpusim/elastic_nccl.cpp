// Elastic NCCL (config.elastic over communicators made by ddp_comm_init_nccl_store) on the simulated
// NCCL: ranks started by `mpirun --enable-recovery` (the simulated NCCL's transport; libddp itself
// meets over Gloo and a file store) train a small model by SGD with every grad in device memory.
//   kill: the last rank SIGKILLs itself at step 2 after some grads were marked ready. The others must
//         get DDP_ERR_RANK_LOST, recover over a new NCCL communicator, take the state of the rank
//         that committed the most, and finish.
//   kill0: the same with rank 0 (the next rank 0 makes the new NCCL id).
//   kill2: as kill, and the last rank but one dies inside the recovery (ELASTIC_VICTIM2_US after it
//         began, default 30 ms: in the agreement or the new communicator's creation).
//   stall: the last rank sleeps past the others' timeout (3 s here) before its backward at step 2,
//         alive: the others leave it out at the timeout, and its own ddp_recover says so.
//   join: the last rank starts as a joiner (ddp_comm_join_nccl) and is admitted at a step boundary;
//         it takes the state of a live rank and trains on in step with the others.
// Each finishing rank checks its parameters against a float64 replay of the steps it took part in
// (the membership of each step learned from the others) and prints
//   "elastic-nccl rank ID: done, N steps, world W, hash H, replay ok|BAD"
// run_elastic.sh checks the lines: every expected rank done, one hash for all, replay ok.
// and, after a loss, how long after the death its first step committed (the victim writes the time
// of its death into DIR/death).
// Usage: elastic_nccl kill|kill0|kill2|stall|join DIR LAYOUT(0 copy, 1 arena) STREAMS  (the file store in DIR/store)
#include <signal.h>
#include <unistd.h>

#include <cuda_runtime_api.h>
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "ddp.h"

namespace {

constexpr int kSteps = 7;
constexpr double kLr = 0.05;
const size_t kSizes[] = {1000, 37, 2500, 640};
constexpr size_t kGrads = sizeof kSizes / sizeof kSizes[0];

int g_id = 0;
const long kVictim2DelayUs = std::getenv("ELASTIC_VICTIM2_US") ? std::atol(std::getenv("ELASTIC_VICTIM2_US")) : 30000;

#define CHECK_OK(call)                                                                                                 \
  do {                                                                                                                 \
    ddp_status_t st_ = (call);                                                                                         \
    if (st_ != DDP_SUCCESS) {                                                                                          \
      std::printf("elastic-nccl rank %d: %s failed: %s: %s\n", g_id, #call, ddp_status_string(st_), ddp_last_error()); \
      std::fflush(stdout);                                                                                             \
      _exit(3);                                                                                                        \
    }                                                                                                                  \
  } while (0)
#define CHECK_CUDA(call)                                             \
  do {                                                               \
    if ((call) != cudaSuccess) {                                     \
      std::printf("elastic-nccl rank %d: %s failed\n", g_id, #call); \
      std::fflush(stdout);                                           \
      _exit(3);                                                      \
    }                                                                \
  } while (0)

float init_value(size_t g, size_t i) { return static_cast<float>(0.5 - 0.001 * static_cast<double>((i * 7 + g) % 97)); }
float grad_value(int id, int64_t step, size_t g, size_t i) {
  return static_cast<float>(0.25 * (id + 1) + 0.125 * static_cast<double>(step % 5) +
                            0.0625 * static_cast<double>((i + g) % 11) - 0.5);
}

long long now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The time of the victim's death (or stall), for the survivors' figure.
void note_death(const std::string& dir) {
  if (FILE* f = std::fopen((dir + "/death").c_str(), "w")) {
    std::fprintf(f, "%lld\n", now_ms());
    std::fclose(f);
  }
}

uint64_t fnv(const std::vector<std::vector<float>>& params) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& p : params)
    for (float v : p) {
      uint32_t bits;
      std::memcpy(&bits, &v, sizeof bits);
      for (int k = 0; k < 4; ++k) h = (h ^ ((bits >> (8 * k)) & 0xff)) * 1099511628211ull;
    }
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: elastic_nccl kill|kill0|kill2|stall|join DIR LAYOUT STREAMS\n");
    return 2;
  }
  const std::string mode = argv[1], dir = argv[2], store = "file://" + dir + "/store";
  const int layout = std::atoi(argv[3]), streams = std::atoi(argv[4]);
  // The simulated NCCL's transport is MPI, whose start is collective over the job: every process
  // starts it now, the joiner too (it makes its NCCL communicator only once admitted).
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int np = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &g_id);
  MPI_Comm_size(MPI_COMM_WORLD, &np);
  const int last = np - 1;
  // kill: the last rank dies; kill0: rank 0 does (the next rank 0 makes the new NCCL id); stall: the
  // last rank sleeps past the others' timeout, alive, and must learn it was left out.
  const bool stalls = mode == "stall";
  const bool joiner = mode == "join" && g_id == last;
  const bool victim = ((mode == "kill" || mode == "kill2" || stalls) && g_id == last) || (mode == "kill0" && g_id == 0);
  const bool victim2 = mode == "kill2" && g_id == last - 1;  // dies as it enters the first recovery
  const int job = mode == "join" ? np - 1 : np;              // the ranks that start the job
  int devices = 1;
  CHECK_CUDA(cudaGetDeviceCount(&devices));
  const int device = g_id % devices;
  CHECK_CUDA(cudaSetDevice(device));

  ddp_comm_t comm = nullptr;
  if (joiner)
    CHECK_OK(ddp_comm_join_nccl(store.c_str(), device, 60000, &comm));
  else
    CHECK_OK(ddp_comm_init_nccl_store_timeout(store.c_str(), g_id, job, device, 60000, &comm));
  ddp_config_t cfg;
  ddp_config_init(&cfg);
  cfg.elastic = 1;
  // (a second death inside the recovery costs up to twice timeout_ms on NCCL: 3 s keeps kill2 short)
  cfg.timeout_ms = stalls || mode == "kill2" ? 3000 : 10000;
  cfg.layout = layout;
  cfg.num_streams = streams;
  cfg.message_size = 1500;
  ddp_t ddp = nullptr;
  CHECK_OK(ddp_create(comm, &cfg, &ddp));

  std::vector<std::vector<float>> params(kGrads), host(kGrads);
  std::vector<std::vector<double>> replay(kGrads);
  std::vector<float*> grads(kGrads, nullptr);
  float* stage = nullptr;  // device memory for the state broadcast
  size_t total = 0;
  for (size_t g = 0; g < kGrads; ++g) {
    params[g].resize(kSizes[g]);
    host[g].resize(kSizes[g]);
    replay[g].resize(kSizes[g]);
    for (size_t i = 0; i < kSizes[g]; ++i) replay[g][i] = params[g][i] = init_value(g, i);
    if (!layout) CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&grads[g]), kSizes[g] * sizeof(float)));
    int index = 0;
    CHECK_OK(ddp_register_grad(ddp, layout ? nullptr : grads[g], kSizes[g], DDP_F32, 0, &index));
    total += kSizes[g];
  }
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&stage), total * sizeof(float)));
  auto find_grads = [&] {
    if (!layout) return;
    for (size_t g = 0; g < kGrads; ++g) {
      void* p = nullptr;
      CHECK_OK(ddp_grad_ptr(ddp, static_cast<int>(g), &p));
      grads[g] = static_cast<float*>(p);
    }
  };
  std::vector<int> ids;
  for (int r = 0; r < job; ++r) ids.push_back(r);
  int64_t step = 0;
  bool replay_from_start = !joiner;
  // A membership change: ddp_recover, every rank's identity, the state of the source.
  // A rank lost on the way (after the agreement, during the state's broadcast) is one more change:
  // round again.
  auto change = [&]() {
    if (victim2)  // dies somewhere inside its recovery: the others' agreement or new NCCL communicator loses it
      std::thread([] {
        usleep(kVictim2DelayUs);
        raise(SIGKILL);
      }).detach();
    ddp_membership_t m;
    for (;;) {
      ddp_status_t st = ddp_recover(ddp, &m, nullptr, 0);
      for (int tries = 0; st == DDP_ERR_TIMEOUT && tries < 3; ++tries) st = ddp_recover(ddp, &m, nullptr, 0);
      if (victim && stalls && st == DDP_ERR_RANK_LOST && std::strstr(ddp_last_error(), "left out")) {
        std::printf("elastic-nccl rank %d: left out, as it should be: %s\n", g_id, ddp_last_error());
        std::fflush(stdout);
        ddp_destroy(ddp);  // the others went on without this rank: it leaves the job
        ddp_comm_destroy(comm);
        _exit(0);
      }
      CHECK_OK(st);
      std::vector<int32_t> all(static_cast<size_t>(m.world), 0);
      all[static_cast<size_t>(m.rank)] = g_id + 1;
      st = ddp_allreduce_host(ddp, all.data(), all.size(), DDP_I32, DDP_OP_SUM);
      if (st == DDP_ERR_RANK_LOST) continue;
      CHECK_OK(st);
      ids.clear();
      for (int32_t x : all) ids.push_back(x - 1);
      size_t at = 0;
      for (size_t g = 0; g < kGrads; at += kSizes[g], ++g)
        CHECK_CUDA(cudaMemcpy(stage + at, params[g].data(), kSizes[g] * sizeof(float), cudaMemcpyHostToDevice));
      void* buf = stage;
      const size_t count = total;
      const ddp_dtype_t type = DDP_F32;
      st = ddp_broadcast(ddp, &buf, &count, &type, 1, m.source, nullptr);
      if (st == DDP_ERR_RANK_LOST) continue;
      CHECK_OK(st);
      CHECK_CUDA(cudaDeviceSynchronize());
      at = 0;
      for (size_t g = 0; g < kGrads; at += kSizes[g], ++g)
        CHECK_CUDA(cudaMemcpy(params[g].data(), stage + at, kSizes[g] * sizeof(float), cudaMemcpyDeviceToHost));
      break;
    }
    if (step < m.committed && replay_from_start) {
      std::printf("elastic-nccl rank %d: this rank is behind (%lld < %lld): the replay cannot follow\n", g_id,
                  static_cast<long long>(step), static_cast<long long>(m.committed));
      replay_from_start = false;
    }
    if (!replay_from_start)  // the replay goes on from the state taken
      for (size_t g = 0; g < kGrads; ++g)
        for (size_t i = 0; i < kSizes[g]; ++i) replay[g][i] = params[g][i];
    step = m.committed;
  };
  if (joiner) change();  // admitted at the job's next step boundary
  find_grads();
  int lost = 0, joined = 0;
  long long first_commit_ms = 0;  // the first step committed after a loss
  // The job goes on (slowly, bounded) until its joiner is in: a step or two may pass before it asks.
  auto waiting = [&] { return mode == "join" && static_cast<int>(ids.size()) < np && step < kSteps + 200; };
  while (step < kSteps || waiting()) {
    if (step >= kSteps) usleep(50000);
    if (victim && stalls && step == 2) {  // past the others' timeout and their wait for late ranks
      note_death(dir);
      usleep(2 * 3000 * 1000 + 2000 * 1000);
    }
    ddp_status_t st = ddp_begin_backward(ddp, nullptr);
    for (size_t g = 0; g < kGrads && st == DDP_SUCCESS; ++g) {
      const size_t k = (g + static_cast<size_t>(g_id)) % kGrads;  // a different order on every rank
      if (victim && !stalls && step == 2 && g == 2) {
        note_death(dir);
        raise(SIGKILL);
      }
      for (size_t i = 0; i < kSizes[k]; ++i) host[k][i] = grad_value(g_id, step, k, i);
      CHECK_CUDA(cudaMemcpy(grads[k], host[k].data(), kSizes[k] * sizeof(float), cudaMemcpyHostToDevice));
      st = ddp_grad_ready(ddp, static_cast<int>(k));
    }
    if (st == DDP_SUCCESS) st = ddp_finish_backward(ddp, nullptr);
    if (st == DDP_SUCCESS) {
      CHECK_CUDA(cudaDeviceSynchronize());
      find_grads();
      for (size_t g = 0; g < kGrads; ++g) {
        CHECK_CUDA(cudaMemcpy(host[g].data(), grads[g], kSizes[g] * sizeof(float), cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < kSizes[g]; ++i) {
          params[g][i] -= static_cast<float>(kLr) * host[g][i];
          double mean = 0;
          for (int id : ids) mean += grad_value(id, step, g, i);
          replay[g][i] -= kLr * (mean / static_cast<double>(ids.size()));
        }
      }
      ++step;
      if (lost && !first_commit_ms) first_commit_ms = now_ms();
      continue;
    }
    if (st != DDP_ERR_RANK_LOST && st != DDP_ERR_RANK_JOINING) CHECK_OK(st);
    (st == DDP_ERR_RANK_LOST ? lost : joined) += 1;
    change();
    find_grads();
  }
  double worst = 0;
  for (size_t g = 0; g < kGrads; ++g)
    for (size_t i = 0; i < kSizes[g]; ++i)
      worst = std::fmax(worst, std::fabs(params[g][i] - replay[g][i]) / (1e-3 + std::fabs(replay[g][i])));
  long long death_ms = 0;
  if (FILE* f = std::fopen((dir + "/death").c_str(), "r")) {
    if (std::fscanf(f, "%lld", &death_ms) != 1) death_ms = 0;
    std::fclose(f);
  }
  std::printf(
      "elastic-nccl rank %d: done, %lld steps, world %zu, lost %d, joined %d, hash %016llx, replay %s (%.2g), first "
      "step %lld ms after the death\n",
      g_id, static_cast<long long>(step), ids.size(), lost, joined, static_cast<unsigned long long>(fnv(params)),
      worst < 1e-5 ? "ok" : "BAD", worst, death_ms && first_commit_ms ? first_commit_ms - death_ms : -1);
  std::fflush(stdout);
  ddp_destroy(ddp);
  ddp_comm_destroy(comm);
  std::fflush(stdout);
  _exit(0);  // a dead peer's MPI world cannot be finalized: no atexit
}
