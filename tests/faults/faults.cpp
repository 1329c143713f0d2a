// Fault tests under mpirun. One scenario per run, named on the command line:
//
//   faults SCENARIO SEED TIMEOUT_MS
//
//   die-exit   the last rank exits in the middle of a backward pass (run with --enable-recovery)
//   die-kill   the last rank SIGKILLs itself there (run with --enable-recovery)
//   stall      the last rank sleeps past the timeout there, then carries on
//   mismatch   ranks register different grads, or configs that differ in one field
//   unused     ranks leave different grads unused, under both unused policies
//   nonfinite  NaN and Inf travel through unchanged; check_finite counts their buckets
//   threads    grads marked ready from several threads at once give the results of one thread
//   blocked    the last rank SIGKILLs itself while the others' workers sit in a blocking collective
//              with it (run with --enable-recovery): the survivors' finish keeps the deadline, the
//              worker is left behind, and destroy and exit() do not wait for it
//   inspect-kill, inspect-stall, inspect-skip, inspect-slow, inspect-destroy
//              the stall inspector: the last rank is killed, stalls past the timeout, issues a
//              different collective (ddp_broadcast instead of its grads), is slow but within the
//              timeout, or destroys its context in mid-backward (which must return at once). Every survivor's timeout
//              message names exactly that rank (no answer, or behind) and where the others are; the stall warning
//              reaches the log callback once, at stall_warning_ms, with the same picture; the slow rank causes a
//              warning and no error
//   create-late the last rank never calls ddp_create: the others' ddp_create returns DDP_ERR_TIMEOUT
//              within timeout_ms (it duplicates the communicator, a collective)
//   gloo-init-die (Gloo only) the last rank dies inside ddp_comm_init_gloo_timeout, after publishing its
//              addresses and before connecting: the others' creation ends within the bound given
//   exit-no-destroy every rank trains, then leaves through exit() without ddp_destroy (over MPI the
//              library initialized MPI, so its own MPI_Finalize runs at exit with the context alive)
//   exit-timeout the last rank SIGKILLs itself while the others' workers are inside a blocking
//              collective with it; after the timeout rank 0 destroys its context and leaves through
//              exit(), the others leave through exit() without destroying (run with --enable-recovery)
//              run.sh runs the exit-* scenarios under a wrapper that prints each rank's exit status
//   join-kill  uneven inputs: the last rank calls ddp_join after one iteration and is SIGKILLed inside it,
//              while it shadows the others' iteration (run with --enable-recovery); at 4 ranks one
//              survivor is inside ddp_join too
//
// Every check prints one line "RESULT <check> ok|FAIL <detail>" (from every surviving rank, or from
// rank 0 once all ranks agree), and every rank that gets to the end prints "DONE rank <r>".
// tests/faults/run.sh runs each scenario under a time bound and reads these lines.
#include <mpi.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../support/exact_grads.hpp"

using namespace faults;

namespace {

int g_rank = 0, g_world = 1;
uint64_t g_seed = 1;
int64_t g_timeout_ms = 2000;
// Slack on top of timeout_ms for a survivor to notice and return: polling, an oversubscribed host.
constexpr double kMarginMs = 1500;

void result(const std::string& check, bool ok, const std::string& detail) {
  std::printf("RESULT %s %s [rank %d] %s\n", check.c_str(), ok ? "ok" : "FAIL", g_rank, detail.c_str());
  std::fflush(stdout);
}

// One verdict for all ranks (every rank must be alive).
void result_all(const std::string& check, bool ok_here, const std::string& detail) {
  int ok = ok_here ? 1 : 0, all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!ok_here)
    result(check, false, detail);
  else if (g_rank == 0)
    result(check, all != 0, all ? detail : "failed on another rank");
}

void done() {
  std::printf("DONE rank %d\n", g_rank);
  std::fflush(stdout);
}

// Waits until `count` ranks have reached the point `what` (this one included), meeting in
// DDP_TEST_RUN_DIR, a directory run.sh makes for each scenario; gives up after timeout_ms + 5 s.
// Without the directory it returns at once.
void meet(const char* what, int count) {
  const char* dir = std::getenv("DDP_TEST_RUN_DIR");
  if (dir == nullptr || *dir == '\0') return;
  const std::string at = std::string(dir) + "/" + what + ".";
  if (FILE* f = std::fopen((at + std::to_string(g_rank)).c_str(), "w")) std::fclose(f);
  const double until = now_ms() + static_cast<double>(g_timeout_ms) + 5000.0;
  for (;;) {
    int seen = 0;
    for (int r = 0; r < g_world; ++r)
      if (FILE* f = std::fopen((at + std::to_string(r)).c_str(), "r")) {
        std::fclose(f);
        ++seen;
      }
    if (seen >= count || now_ms() > until) return;
    usleep(10 * 1000);
  }
}

// Leaves without MPI_Finalize (a dead or late peer can make it wait forever), but only once the
// other `survivors` have printed DONE too: mpirun ends the job when the first rank exits without
// finalizing, which would kill a survivor still inside its checks (over Gloo one survivor can learn
// of the death at once and another only at its timeout).
[[noreturn]] void leave_with(int survivors) {
  std::fflush(stdout);
  meet("done", survivors);
  _exit(0);
}

std::string status_text(ddp_status_t s) {
  return std::string(ddp_status_string(s)) + (s ? std::string(": ") + ddp_last_error() : std::string());
}

ddp_comm_t g_comm = nullptr;
// DDP_TEST_GLOO=METHOD: the scenarios run over Gloo (mpirun only starts the ranks).
bool g_gloo = false;

// The least time a survivor may take to give up on a peer that died (a fault of kind `dead`) or
// stalled: half the timeout, so that a timeout never fires early. Gloo learns of a dead peer from its
// socket at once: no lower bound then.
double least_wait_ms(bool dead) { return g_gloo && dead ? 0.0 : 0.5 * static_cast<double>(g_timeout_ms); }

struct Ctx {
  ddp_t d = nullptr;
  std::vector<Grad> grads;
};

ddp_config_t base_config() {
  ddp_config_t c;
  ddp_config_init(&c);
  c.timeout_ms = g_timeout_ms;
  c.message_size = 1200;  // several buckets per dtype
  c.num_streams = 2;
  return c;
}

// Creates a context and registers `n` grads (copy layout: the harness's buffers).
ddp_status_t make_ctx(Ctx* x, const ddp_config_t& cfg, int n) {
  x->grads = make_grads(n);
  ddp_status_t s = ddp_create(g_comm, &cfg, &x->d);
  if (s) return s;
  for (Grad& g : x->grads) {
    s = ddp_register_grad(x->d, cfg.layout == DDP_LAYOUT_ARENA ? nullptr : g.buf.data(), g.numel, g.dtype, 0, &g.index);
    if (s) return s;
  }
  return ddp_commit(x->d);
}

void* where(Ctx& x, Grad& g) {
  void* p = nullptr;
  if (ddp_grad_ptr(x.d, g.index, &p) != DDP_SUCCESS) return nullptr;
  return p;
}

void fill(Ctx& x, int iter) {
  for (size_t gi = 0; gi < x.grads.size(); ++gi) {
    Grad& g = x.grads[gi];
    void* p = where(x, g);
    for (size_t i = 0; i < g.numel; ++i) store(p, i, g.dtype, value(g_seed, g_rank, iter, static_cast<int>(gi), i));
  }
}

// Compares every grad with the average over `givers` of what those ranks gave (the default
// gradient_average with predivide 1: sum / world).
bool verify(Ctx& x, int iter, const std::function<bool(int rank, int grad)>& gave, std::string* why) {
  for (size_t gi = 0; gi < x.grads.size(); ++gi) {
    Grad& g = x.grads[gi];
    const void* p = where(x, g);
    for (size_t i = 0; i < g.numel; ++i) {
      double sum = 0;
      for (int r = 0; r < g_world; ++r)
        if (gave(r, static_cast<int>(gi))) sum += value(g_seed, r, iter, static_cast<int>(gi), i);
      // Sums of quarters are exact; the division by the world size rounds once in the grad's dtype.
      const double want = sum / g_world, got = load(p, i, g.dtype);
      const double tol = g.dtype == DDP_F64 ? 1e-12 : g.dtype == DDP_F32 ? 1e-6 : g.dtype == DDP_F16 ? 1e-3 : 8e-3;
      if (!(std::fabs(got - want) <= tol * std::max(1.0, std::fabs(want)))) {
        char b[200];
        std::snprintf(b, sizeof b, "iteration %d grad %zu[%zu]: %.9g, expected %.9g", iter, gi, i, got, want);
        *why = b;
        return false;
      }
    }
  }
  return true;
}

bool all_gave(int, int) { return true; }

// ---------------------------------------------------------------------------------------------
// A rank dies, or stalls, in the middle of iteration 2.
// ---------------------------------------------------------------------------------------------

enum class Fault { Exit, Kill, Stall };

// After a fatal error: the next call answers DDP_ERR_ABORTED at once.
template <class F>
void check_aborted(const std::string& name, F&& call) {
  const double t = now_ms();
  const ddp_status_t s = call();
  result(name + "-aborted", s == DDP_ERR_ABORTED && now_ms() - t < 100, "next call -> " + status_text(s));
}

// ddp_destroy returns within the bound whatever state the context is in.
void check_destroy(const std::string& name, ddp_t d) {
  const double t = now_ms();
  ddp_destroy(d);
  const double dt = now_ms() - t;
  result(name + "-destroy", dt <= g_timeout_ms + kMarginMs,
         "ddp_destroy took " + std::to_string(static_cast<int>(dt)) + " ms");
}

ddp_config_t shard_config() {
  ddp_config_t cfg = base_config();
  cfg.layout = DDP_LAYOUT_ARENA;
  cfg.plan_order = DDP_PLAN_REGISTRATION;
  cfg.shard = 1;
  return cfg;
}

// `shard`: a sharded context, whose buckets are reduce-scattered (outside its shard a rank's grads
// hold partial sums, so the warm-up checks only statuses; the shard suite checks values).
int run_fault(Fault fault, const char* name, bool shard = false) {
  const int victim = g_world - 1;
  Ctx x;
  ddp_config_t cfg = shard ? shard_config() : base_config();
  ddp_status_t s = make_ctx(&x, cfg, 12);
  if (s) {
    result(name, false, "setup: " + status_text(s));
    return 1;
  }
  // Two good iterations first (the first learns the plan); then the fault.
  for (int it = 0; it < 2; ++it) {
    ddp_begin_backward(x.d, nullptr);
    fill(x, it);
    for (int g = static_cast<int>(x.grads.size()) - 1; g >= 0; --g) ddp_grad_ready(x.d, g);
    s = ddp_finish_backward(x.d, nullptr);
    std::string why;
    if (s || (!shard && !verify(x, it, all_gave, &why))) {
      result(name, false, "warm-up iteration: " + (s ? status_text(s) : why));
      return 1;
    }
  }
  const int it = 2;
  const int n = static_cast<int>(x.grads.size());
  ddp_begin_backward(x.d, nullptr);
  fill(x, it);
  const double t0 = now_ms();
  if (g_rank == victim) {
    for (int g = n - 1; g >= n / 2; --g) ddp_grad_ready(x.d, g);  // some buckets go out
    std::fflush(stdout);
    if (fault == Fault::Exit) _exit(3);
    if (fault == Fault::Kill) raise(SIGKILL);
    usleep(static_cast<useconds_t>((g_timeout_ms + 1000) * 1000));
    for (int g = n / 2 - 1; g >= 0; --g) ddp_grad_ready(x.d, g);
    const double t1 = now_ms();
    s = ddp_finish_backward(x.d, nullptr);
    const double took = now_ms() - t1;
    // Whatever the late rank gets (its peers gave up), it must get it within the bound.
    bool ok = (s == DDP_SUCCESS || s == DDP_ERR_TIMEOUT || s == DDP_ERR_ABORTED) && took <= g_timeout_ms + kMarginMs;
    char b[160];
    std::snprintf(b, sizeof b, "late rank: finish after %.0f ms -> ", took);
    result(std::string(name) + "-late-rank", ok, b + status_text(s));
  } else {
    for (int g = n - 1; g >= 0; --g) ddp_grad_ready(x.d, g);
    s = ddp_finish_backward(x.d, nullptr);
    const double took = now_ms() - t0;
    const std::string msg = ddp_last_error();
    bool ok = (s == DDP_ERR_TIMEOUT || s == DDP_ERR_ABORTED) && took <= g_timeout_ms + kMarginMs &&
              took >= least_wait_ms(fault != Fault::Stall) && msg.find("iteration 2") != std::string::npos &&
              msg.find("bucket") != std::string::npos;
    char b[160];
    std::snprintf(b, sizeof b, "finish after %.0f ms (timeout %lld) -> ", took, static_cast<long long>(g_timeout_ms));
    result(name, ok, b + status_text(s));
    // The context is now aborted: every call says so at once.
    check_aborted(name, [&] { return ddp_begin_backward(x.d, nullptr); });
  }
  check_destroy(name, x.d);
  done();
  // A dead peer can make MPI_Finalize wait forever, and the late rank's written-off worker can still be
  // inside a collective whose partners gave up (MPI_Finalize under a thread in MPI is undefined): no
  // rank finalizes.
  leave_with(fault == Fault::Stall ? g_world : g_world - 1);
}

// ---------------------------------------------------------------------------------------------
// Sharded: a rank dies, or stalls, instead of gathering its parameter shards. The others' gathers
// wait for it: ddp_wait_params returns DDP_ERR_TIMEOUT within the bound, naming the gather.
// ---------------------------------------------------------------------------------------------

int run_gather_fault(Fault fault, const char* name) {
  const int victim = g_world - 1;
  Ctx x;
  ddp_status_t s = make_ctx(&x, shard_config(), 12);
  const int n = static_cast<int>(x.grads.size());
  for (int it = 0; !s && it < 2; ++it) {
    ddp_begin_backward(x.d, nullptr);
    fill(x, it);
    for (int g = n - 1; g >= 0; --g) ddp_grad_ready(x.d, g);
    s = ddp_finish_backward(x.d, nullptr);
    if (!s && it == 0) s = ddp_gather_params(x.d, nullptr);
    if (!s && it == 0) s = ddp_wait_params(x.d, -1, nullptr);
  }
  if (s) {
    result(name, false, "setup: " + status_text(s));
    return 1;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (g_rank == victim) {
    std::fflush(stdout);
    if (fault == Fault::Kill) raise(SIGKILL);
    usleep(static_cast<useconds_t>((g_timeout_ms + 1000) * 1000));
    s = ddp_gather_params(x.d, nullptr);
    if (!s) s = ddp_wait_params(x.d, -1, nullptr);
    result(std::string(name) + "-late-rank", s == DDP_SUCCESS || s == DDP_ERR_TIMEOUT || s == DDP_ERR_ABORTED,
           "late rank's gather -> " + status_text(s));
  } else {
    const double t0 = now_ms();
    s = ddp_gather_params(x.d, nullptr);
    if (!s) s = ddp_wait_params(x.d, 0, nullptr);  // the first parameter's bucket comes last
    const double took = now_ms() - t0;
    const std::string msg = ddp_last_error();
    const bool ok = s == DDP_ERR_TIMEOUT && took <= g_timeout_ms + kMarginMs &&
                    took >= least_wait_ms(fault != Fault::Stall) && msg.find("parameter gather") != std::string::npos;
    char b[160];
    std::snprintf(b, sizeof b, "wait after %.0f ms (timeout %lld) -> ", took, static_cast<long long>(g_timeout_ms));
    result(name, ok, b + status_text(s) + (ok ? "" : ": " + msg));
    check_aborted(name, [&] { return ddp_wait_params(x.d, -1, nullptr); });
  }
  check_destroy(name, x.d);
  done();
  leave_with(fault == Fault::Stall ? g_world : g_world - 1);
}

// ---------------------------------------------------------------------------------------------
// A worker blocked for good in a dead peer's collective: finish returns at the deadline, destroy at
// once, and the process leaves through exit() (static destructors, atexit) with the worker still in
// the collective (the host ring's exchange with the dead peer). One grad of 8M f32: the survivor's worker is inside the
// collective when the peer dies.
// ---------------------------------------------------------------------------------------------

// The library's bucket workers and stall-inspector responders alive now (threads it names
// "ddp-worker" and "ddp-inspector"): not a count of every thread, which MPI's own threads change
// while they handle the peer's death (one left between the two counts, and the check failed).
int threads_now() {
  int n = 0;
  if (DIR* dir = opendir("/proc/self/task")) {
    while (dirent* e = readdir(dir)) {
      if (e->d_name[0] == '.') continue;
      char path[300], name[64] = "";
      std::snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
      if (FILE* f = std::fopen(path, "r")) {
        if (std::fgets(name, sizeof name, f) &&
            (!std::strncmp(name, "ddp-worker", 10) || !std::strncmp(name, "ddp-inspector", 13)))
          ++n;
        std::fclose(f);
      }
    }
    closedir(dir);
  }
  return n;
}

// A context of one grad of 8M f32 (one bucket, one stream), after two good iterations.
void one_big_bucket(const char* name, ddp_t* d, int* index) {
  ddp_config_t cfg = base_config();
  cfg.layout = DDP_LAYOUT_ARENA;
  cfg.num_streams = 1;
  ddp_status_t s = ddp_create(g_comm, &cfg, d);
  if (!s) s = ddp_register_grad(*d, nullptr, size_t(8) << 20, DDP_F32, 0, index);
  if (!s) s = ddp_commit(*d);
  for (int it = 0; !s && it < 2; ++it) {
    ddp_begin_backward(*d, nullptr);
    ddp_grad_ready(*d, *index);
    s = ddp_finish_backward(*d, nullptr);
  }
  if (s) {
    result(name, false, "warm-up: " + status_text(s));
    std::exit(1);
  }
}

void run_blocked() {
  const int victim = g_world - 1;
  ddp_t d = nullptr;
  int index = -1;
  one_big_bucket("blocked", &d, &index);
  MPI_Barrier(MPI_COMM_WORLD);
  if (g_rank == victim) {
    usleep(300 * 1000);  // the survivors are inside the collective by now
    std::fflush(stdout);
    raise(SIGKILL);
  }
  ddp_begin_backward(d, nullptr);
  const double t0 = now_ms();
  ddp_grad_ready(d, index);
  const ddp_status_t s = ddp_finish_backward(d, nullptr);
  const double took = now_ms() - t0;
  char b[200];
  std::snprintf(b, sizeof b, "finish after %.0f ms (timeout %lld) -> ", took, static_cast<long long>(g_timeout_ms));
  result("blocked", s == DDP_ERR_TIMEOUT && took <= g_timeout_ms + 1000.0, b + status_text(s));
  const int before = threads_now();
  const double t1 = now_ms();
  ddp_destroy(d);
  const double dt = now_ms() - t1;
  const int after = threads_now();
  // Under MPI the written-off worker outlives the context and the stall inspector's responder thread
  // is joined: two threads fewer would mean the blocked worker was joined too. Gloo's worker is not
  // blocked (the dead peer's socket fails its collective at once): both are joined.
  const int joined = g_gloo ? 2 : 1;
  std::snprintf(b, sizeof b, "ddp_destroy took %.0f ms; threads %d before, %d after (%s)", dt, before, after,
                g_gloo ? "the inspector's responder and the worker joined"
                       : "the inspector's responder joined, the blocked worker left behind");
  result("blocked-destroy", dt < 100 && after == before - joined, b);
  done();
  std::fflush(stdout);
  std::exit(0);  // not _exit: static destructors and atexit run with the worker still blocked
}

// ---------------------------------------------------------------------------------------------
// Ranks that disagree: every rank gets DDP_ERR_MISMATCH naming the first difference.
// ---------------------------------------------------------------------------------------------

void run_mismatch() {
  struct Case {
    const char* name;
    const char* expect;  // in the message
    std::function<void(ddp_config_t&, std::vector<Grad>&)> tweak;
  };
  auto retype = [](Grad& g, ddp_dtype_t d) {
    g.dtype = d;
    g.buf.assign(g.numel * esize(d), 0);
  };
  const std::vector<Case> cases = {
      {"numel", "grad 3",
       [](ddp_config_t&, std::vector<Grad>& g) {
         g[3].numel += 1;
         g[3].buf.resize(g[3].numel * 8);
       }},
      {"dtype", "grad 1", [&](ddp_config_t&, std::vector<Grad>& g) { retype(g[1], DDP_F32); }},
      {"count", "registered", [](ddp_config_t&, std::vector<Grad>& g) { g.pop_back(); }},
      {"message_size", "message_size", [](ddp_config_t& c, std::vector<Grad>&) { c.message_size *= 2; }},
      {"num_streams", "num_streams", [](ddp_config_t& c, std::vector<Grad>&) { c.num_streams = 3; }},
      {"layout", "layout", [](ddp_config_t& c, std::vector<Grad>&) { c.layout = DDP_LAYOUT_ARENA; }},
      {"plan_order", "plan_order", [](ddp_config_t& c, std::vector<Grad>&) { c.plan_order = DDP_PLAN_REGISTRATION; }},
      {"delay_allreduce", "delay_allreduce", [](ddp_config_t& c, std::vector<Grad>&) { c.delay_allreduce = 1; }},
      {"predivide", "gradient_predivide_factor",
       [](ddp_config_t& c, std::vector<Grad>&) { c.gradient_predivide_factor = 2; }},
      {"unused_policy", "unused_policy",
       [](ddp_config_t& c, std::vector<Grad>&) { c.unused_policy = DDP_UNUSED_ZERO; }},
  };
  for (const Case& k : cases) {
    const std::string check = std::string("mismatch-") + k.name;
    ddp_config_t cfg = base_config();
    std::vector<Grad> grads = make_grads(8);
    if (g_rank == g_world - 1) k.tweak(cfg, grads);
    const double t0 = now_ms();
    ddp_t d = nullptr;
    ddp_status_t s = ddp_create(g_comm, &cfg, &d);
    const char* stage = "ddp_create";
    if (s == DDP_SUCCESS) {
      for (Grad& g : grads) {
        s = ddp_register_grad(d, cfg.layout == DDP_LAYOUT_ARENA ? nullptr : g.buf.data(), g.numel, g.dtype, 0,
                              &g.index);
        if (s) break;
      }
      stage = "ddp_commit";
      if (s == DDP_SUCCESS) s = ddp_commit(d);
    }
    const double took = now_ms() - t0;
    const std::string msg = ddp_last_error();
    bool ok = s == DDP_ERR_MISMATCH && msg.find(k.expect) != std::string::npos && took < g_timeout_ms;
    if (d && ok) {
      ddp_status_t s2 = ddp_begin_backward(d, nullptr);
      ok = s2 == DDP_ERR_ABORTED;
    }
    ddp_destroy(d);
    char b[96];
    std::snprintf(b, sizeof b, "%s after %.0f ms -> ", stage, took);
    result_all(check, ok, b + std::string(ddp_status_string(s)) + ": " + msg);
  }
}

// ---------------------------------------------------------------------------------------------
// Rank r >= 1 leaves grad r unused. Zero policy: success and one result everywhere. Error policy:
// every rank reports every rank's unused grads, and the values are still the same everywhere.
// ---------------------------------------------------------------------------------------------

uint64_t checksum(Ctx& x) {
  uint64_t h = 1469598103934665603ull;
  for (Grad& g : x.grads) {
    const unsigned char* p = static_cast<const unsigned char*>(where(x, g));
    for (size_t i = 0; i < g.numel * esize(g.dtype); ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
  return h;
}

void run_unused() {
  for (int zero = 0; zero < 2; ++zero)
    for (int layout = 0; layout < 2; ++layout)
      for (int plan = 0; plan < 2; ++plan) {
        char check[96];
        std::snprintf(check, sizeof check, "unused-%s-%s-%s", zero ? "zero" : "error", layout ? "arena" : "copy",
                      plan ? "registration" : "learned");
        ddp_config_t cfg = base_config();
        cfg.unused_policy = zero ? DDP_UNUSED_ZERO : DDP_UNUSED_ERROR;
        cfg.layout = layout;
        cfg.plan_order = plan;
        Ctx x;
        ddp_status_t s = make_ctx(&x, cfg, 9);
        bool ok = s == DDP_SUCCESS;
        std::string why = ok ? "" : "setup: " + status_text(s);
        auto gave = [](int r, int g) { return r == 0 || g != r; };
        for (int it = 0; ok && it < 3; ++it) {
          ddp_begin_backward(x.d, nullptr);
          fill(x, it);
          for (int g = static_cast<int>(x.grads.size()) - 1; g >= 0; --g)
            if (gave(g_rank, g)) ddp_grad_ready(x.d, g);
          s = ddp_finish_backward(x.d, nullptr);
          const std::string msg = ddp_last_error();
          if (zero) {
            if (s) ok = false, why = "finish -> " + status_text(s);
          } else {
            if (s != DDP_ERR_INVALID_STATE) ok = false, why = "finish -> " + status_text(s);
            for (int r = 1; ok && r < g_world && r < 9; ++r) {
              const std::string name = "rank " + std::to_string(r) + ": grad " + std::to_string(r);
              if (msg.find(name) == std::string::npos) ok = false, why = "the report lacks '" + name + "': " + msg;
            }
            if (ok && msg.find("rank 0:") != std::string::npos)
              ok = false, why = "rank 0 reported, it used every grad: " + msg;
          }
          if (ok && !verify(x, it, gave, &why)) ok = false;
          // Bitwise the same everywhere.
          uint64_t mine = checksum(x), first = mine;
          MPI_Bcast(&first, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
          if (ok && mine != first) ok = false, why = "the grads differ from rank 0's";
        }
        ddp_destroy(x.d);
        result_all(check, ok, ok ? "3 iterations, every rank the same result" : why);
      }
}

// ---------------------------------------------------------------------------------------------
// NaN and Inf from one rank reach every rank unchanged; check_finite counts the buckets.
// ---------------------------------------------------------------------------------------------

void run_nonfinite() {
  for (int layout = 0; layout < 2; ++layout)
    for (int check_finite = 0; check_finite < 2; ++check_finite) {
      char check[96];
      std::snprintf(check, sizeof check, "nonfinite-%s-check%d", layout ? "arena" : "copy", check_finite);
      ddp_config_t cfg = base_config();
      cfg.layout = layout;
      cfg.plan_order = DDP_PLAN_REGISTRATION;
      cfg.check_finite = check_finite;
      Ctx x;
      ddp_status_t s = make_ctx(&x, cfg, 8);
      bool ok = s == DDP_SUCCESS;
      std::string why = ok ? "" : "setup: " + status_text(s);
      // grad 0 (f32) gets a NaN, grad 2 (f16) +Inf and grad 5 (f64) -Inf, all from the last rank.
      const int bad_grads[3] = {0, 2, 5};
      int nb = 0;
      std::vector<char> bad_bucket;
      if (ok) {
        ddp_get_plan(x.d, &nb, nullptr);
        bad_bucket.assign(static_cast<size_t>(nb), 0);
        for (int b = 0; b < nb; ++b) {
          ddp_bucket_info_t info;
          info.size = sizeof info;
          std::vector<int> members(x.grads.size());
          ddp_get_bucket(x.d, b, &info, members.data(), members.size());
          for (int j = 0; j < info.num_grads; ++j)
            for (int g : bad_grads) bad_bucket[static_cast<size_t>(b)] |= members[static_cast<size_t>(j)] == g;
        }
      }
      const uint64_t want_count = static_cast<uint64_t>(std::count(bad_bucket.begin(), bad_bucket.end(), 1));
      for (int it = 0; ok && it < 2; ++it) {
        ddp_stats_t before;
        before.size = sizeof before;
        ddp_get_stats(x.d, &before);
        ddp_begin_backward(x.d, nullptr);
        fill(x, it);
        const bool inject = it == 0;  // iteration 1 is all finite
        if (inject && g_rank == g_world - 1) {
          store(where(x, x.grads[0]), 3, x.grads[0].dtype, NAN);
          store(where(x, x.grads[2]), 0, x.grads[2].dtype, INFINITY);
          store(where(x, x.grads[5]), 7, x.grads[5].dtype, -INFINITY);
        }
        for (int g = static_cast<int>(x.grads.size()) - 1; g >= 0; --g) ddp_grad_ready(x.d, g);
        s = ddp_finish_backward(x.d, nullptr);
        if (s) {
          ok = false, why = "finish -> " + status_text(s);
          break;
        }
        for (size_t gi = 0; ok && gi < x.grads.size(); ++gi) {
          Grad& g = x.grads[gi];
          const void* p = where(x, g);
          for (size_t i = 0; ok && i < g.numel; ++i) {
            double got = load(p, i, g.dtype);
            bool special = inject && ((gi == 0 && i == 3) || (gi == 2 && i == 0) || (gi == 5 && i == 7));
            if (special) {
              bool right = gi == 0   ? std::isnan(got)
                           : gi == 2 ? (std::isinf(got) && got > 0)
                                     : (std::isinf(got) && got < 0);
              if (!right)
                ok = false, why = "grad " + std::to_string(gi) + " lost its non-finite value: " + std::to_string(got);
            } else if (!std::isfinite(got)) {
              ok = false,
              why = "a non-finite value spread to grad " + std::to_string(gi) + "[" + std::to_string(i) + "]";
            }
          }
        }
        ddp_stats_t after;
        after.size = sizeof after;
        ddp_get_stats(x.d, &after);
        const uint64_t counted = after.nonfinite_buckets - before.nonfinite_buckets;
        const uint64_t want = check_finite && inject ? want_count : 0;
        if (ok && counted != want)
          ok = false,
          why = "nonfinite_buckets grew by " + std::to_string(counted) + ", expected " + std::to_string(want);
      }
      ddp_destroy(x.d);
      result_all(check, ok,
                 ok ? "NaN, +Inf, -Inf arrived on every rank; " + std::to_string(check_finite ? want_count : 0) +
                          " buckets counted"
                    : why);
    }
}

// ---------------------------------------------------------------------------------------------
// Several threads mark grads ready at once: the results are bitwise those of one thread.
// ---------------------------------------------------------------------------------------------

void run_threads() {
  for (int plan = 0; plan < 2; ++plan) {
    const std::string check = std::string("threads-") + (plan ? "registration" : "learned");
    ddp_config_t cfg = base_config();
    cfg.plan_order = plan;
    cfg.num_streams = 3;
    Ctx one, many;
    ddp_status_t s = make_ctx(&one, cfg, 40);
    if (!s) s = make_ctx(&many, cfg, 40);
    bool ok = s == DDP_SUCCESS;
    std::string why = ok ? "" : "setup: " + status_text(s);
    const int n = 40, nthreads = 4;
    for (int it = 0; ok && it < 4; ++it) {
      ddp_begin_backward(one.d, nullptr);
      fill(one, it);
      for (int g = n - 1; g >= 0; --g) ddp_grad_ready(one.d, g);
      ddp_status_t s1 = ddp_finish_backward(one.d, nullptr);
      ddp_begin_backward(many.d, nullptr);
      fill(many, it);
      std::vector<std::thread> ts;
      std::vector<int> bad(nthreads, 0);
      for (int t = 0; t < nthreads; ++t)
        ts.emplace_back([&, t] {
          for (int g = n - 1 - t; g >= 0; g -= nthreads)
            if (ddp_grad_ready(many.d, g) != DDP_SUCCESS) bad[static_cast<size_t>(t)] = 1;
        });
      for (auto& th : ts) th.join();
      ddp_status_t s2 = ddp_finish_backward(many.d, nullptr);
      if (s1 || s2 || std::count(bad.begin(), bad.end(), 1)) {
        ok = false, why = "one thread -> " + std::string(ddp_status_string(s1)) + ", many -> " + ddp_status_string(s2);
        break;
      }
      if (!verify(many, it, all_gave, &why)) ok = false;
      for (int g = 0; ok && g < n; ++g)
        if (std::memcmp(where(one, one.grads[g]), where(many, many.grads[g]), one.grads[g].buf.size()) != 0)
          ok = false, why = "grad " + std::to_string(g) + " differs between one thread and " + std::to_string(nthreads);
    }
    ddp_destroy(one.d);
    ddp_destroy(many.d);
    result_all(check, ok, ok ? "4 iterations, 4 threads marking 40 grads, bitwise the one-thread result" : why);
  }
}

// ---------------------------------------------------------------------------------------------
// The stall inspector
// ---------------------------------------------------------------------------------------------

struct LogEntry {
  double at_ms;
  int level;
  std::string text;
};
std::mutex g_log_mu;
std::vector<LogEntry> g_log;
double g_log_t0 = 0;

extern "C" void collect_log(ddp_log_level_t level, const char* message, void*) {
  std::lock_guard<std::mutex> lock(g_log_mu);
  g_log.push_back(LogEntry{now_ms() - g_log_t0, static_cast<int>(level), message});
}

bool names_exactly(const std::string& msg, const char* what, int rank) {
  const std::string want = std::string(what) + " rank " + std::to_string(rank);
  const size_t at = msg.find(what);
  // "<what> rank V" and nothing after it that lists more ranks ("rank V, W").
  return at != std::string::npos && msg.compare(at, want.size(), want) == 0 &&
         (at + want.size() >= msg.size() || msg[at + want.size()] != ',');
}

int run_inspect(const std::string& kind) {
  const int victim = g_world - 1;
  const int64_t stall_ms = g_timeout_ms / 3;
  ddp_set_log_callback(collect_log, nullptr);
  Ctx x;
  ddp_config_t cfg = base_config();
  cfg.stall_warning_ms = stall_ms;
  ddp_status_t s = make_ctx(&x, cfg, 12);
  const int n = static_cast<int>(x.grads.size());
  for (int it = 0; !s && it < 2; ++it) {  // the first learns the plan
    ddp_begin_backward(x.d, nullptr);
    fill(x, it);
    for (int g = n - 1; g >= 0; --g) ddp_grad_ready(x.d, g);
    s = ddp_finish_backward(x.d, nullptr);
  }
  if (s) {
    result(kind, false, "setup: " + status_text(s));
    return 1;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const int it = 2;
  ddp_begin_backward(x.d, nullptr);
  fill(x, it);
  {
    std::lock_guard<std::mutex> lock(g_log_mu);
    g_log.clear();
    g_log_t0 = now_ms();
  }
  if (g_rank == victim) {
    for (int g = n - 1; g >= n / 2; --g) ddp_grad_ready(x.d, g);
    std::fflush(stdout);
    if (kind == "inspect-kill") raise(SIGKILL);
    if (kind == "inspect-destroy") {
      // Destroyed in the middle of a backward pass, with buckets in flight that nobody will match.
      const double t0 = now_ms();
      s = ddp_destroy(x.d);
      const double took = now_ms() - t0;
      char b[120];
      std::snprintf(b, sizeof b, "ddp_destroy in mid-backward took %.0f ms -> ", took);
      result(kind + "-victim", s == DDP_SUCCESS && took < 500, b + status_text(s));
      done();
      std::fflush(stdout);
      usleep(static_cast<useconds_t>((g_timeout_ms + 1500) * 1000));  // alive, but no longer answering
      leave_with(g_world);
    }
    if (kind == "inspect-stall") usleep(static_cast<useconds_t>((g_timeout_ms + 1000) * 1000));
    if (kind == "inspect-slow") usleep(static_cast<useconds_t>((stall_ms + g_timeout_ms) / 2 * 1000));
    if (kind == "inspect-skip") {
      // Late enough that the others time out (and ask) while this rank still waits in its broadcast.
      usleep(400 * 1000);
      std::vector<double> v(64, 1.0);
      void* bufs[1] = {v.data()};
      size_t counts[1] = {v.size()};
      ddp_dtype_t types[1] = {DDP_F64};
      s = ddp_broadcast(x.d, bufs, counts, types, 1, 0, nullptr);  // nobody else broadcasts: times out
      result(kind + "-victim", s == DDP_ERR_TIMEOUT, "the rank that broadcast instead -> " + status_text(s));
      usleep(1000 * 1000);  // still answers the others' questions
    } else {
      for (int g = n / 2 - 1; g >= 0; --g) ddp_grad_ready(x.d, g);
      s = ddp_finish_backward(x.d, nullptr);
      if (kind == "inspect-slow") result(kind + "-victim", s == DDP_SUCCESS, "slow rank -> " + status_text(s));
    }
  } else {
    for (int g = n - 1; g >= 0; --g) ddp_grad_ready(x.d, g);
    const double t0 = now_ms();
    s = ddp_finish_backward(x.d, nullptr);
    const double took = now_ms() - t0;
    const std::string msg = s ? ddp_last_error() : "";
    std::vector<LogEntry> log;
    {
      std::lock_guard<std::mutex> lock(g_log_mu);
      log = g_log;
    }
    char b[200];
    if (kind == "inspect-slow") {
      std::string why;
      const bool ok = s == DDP_SUCCESS && verify(x, it, all_gave, &why);
      result(kind, ok, "finish -> " + status_text(s) + (why.empty() ? "" : ": " + why));
    } else {
      const bool gone = kind == "inspect-kill" || kind == "inspect-destroy";
      const char* what = gone ? "no answer from" : "behind this rank:";
      const bool ok = s == DDP_ERR_TIMEOUT && took <= g_timeout_ms + 1000.0 + 500.0 &&
                      names_exactly(msg, what, victim) && msg.find("(this rank)") != std::string::npos;
      std::snprintf(b, sizeof b, "finish after %.0f ms (timeout %lld) -> ", took, static_cast<long long>(g_timeout_ms));
      result(kind, ok, b + status_text(s));
      if (kind == "inspect-skip")
        result(kind + "-where", msg.find("in ddp_broadcast") != std::string::npos,
               "the victim's position says it is in ddp_broadcast");
    }
    // One warning, at stall_warning_ms (the first bucket waits from about when finish began), naming
    // the same rank; the killed rank's too.
    int warnings = 0;
    double at = -1;
    bool named = false;
    for (const LogEntry& e : log)
      if (e.level == DDP_LOG_WARN && e.text.find("has waited") != std::string::npos) {
        ++warnings;
        if (at < 0) at = e.at_ms;
        named =
            named ||
            names_exactly(
                e.text,
                kind == "inspect-kill" || kind == "inspect-destroy" ? "no answer from" : "behind this rank:", victim);
      }
    // A peer's death seen at once (Gloo's sockets) fails the call before any warning is due.
    const bool early = s != DDP_SUCCESS && took < 0.8 * stall_ms;
    const bool once = early ? warnings == 0 : warnings == 1 && at >= 0.8 * stall_ms && at <= stall_ms + 1000.0 && named;
    std::snprintf(b, sizeof b, "%d stall warning(s), the first after %.0f ms (stall_warning_ms %lld)%s%s", warnings, at,
                  static_cast<long long>(stall_ms), named ? ", naming the rank" : ", NOT naming the rank",
                  early ? "; the call failed before one was due" : "");
    result(kind + "-warning", once, b);
    // The other survivors may still be asking this rank where it stands, or, when this rank learned of
    // the death at once (Gloo, a neighbour of the victim), still be waiting for their timeout first.
    if (kind != "inspect-slow") {
      const double until = early ? t0 + static_cast<double>(g_timeout_ms) + 1500.0 : now_ms() + 700.0;
      usleep(static_cast<useconds_t>(std::max(0.0, until - now_ms()) * 1000));
    }
  }
  ddp_destroy(x.d);
  ddp_set_log_callback(nullptr, nullptr);
  done();
  if (kind != "inspect-slow") leave_with(kind == "inspect-kill" ? g_world - 1 : g_world);
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Uneven inputs: a rank that has joined (ddp_join after iteration 0) is killed inside ddp_join, while
// it shadows the others' iteration 2 with zeros. At 4 ranks and more the rank before it joins after
// iteration 1: a survivor that is itself inside ddp_join. The survivors that train get
// DDP_ERR_TIMEOUT from ddp_finish_backward, the joined one from ddp_join, within the bound and
// naming exactly the dead rank; then DDP_ERR_ABORTED, and a bounded destroy.
// ---------------------------------------------------------------------------------------------

constexpr int kKillTag = 77;

// One synced backward pass of every grad.
ddp_status_t train(Ctx& x, int it) {
  ddp_status_t s = ddp_begin_backward(x.d, nullptr);
  if (s) return s;
  fill(x, it);
  for (int g = static_cast<int>(x.grads.size()) - 1; g >= 0; --g) ddp_grad_ready(x.d, g);
  return ddp_finish_backward(x.d, nullptr);
}

// Whether process `pid` (of this host: run.sh starts every rank here) has died: gone, or a zombie.
bool has_died(int pid) {
  char buf[512] = {0};
  FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (!f) return true;
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* end = std::strrchr(buf, ')');  // "pid (name) S ...": the name may hold spaces
  return end != nullptr && end[1] == ' ' && (end[2] == 'Z' || end[2] == 'X');
}

int run_join_kill() {
  const char* name = "join-kill";
  const int victim = g_world - 1, joined = g_world >= 4 ? g_world - 2 : -1;
  int victim_pid = static_cast<int>(getpid());
  MPI_Bcast(&victim_pid, 1, MPI_INT, victim, MPI_COMM_WORLD);
  ddp_config_t cfg = base_config();
  cfg.uneven_inputs = DDP_UNEVEN_BY_WORLD;  // averages over the world, as verify() computes them
  Ctx x;
  ddp_status_t s = make_ctx(&x, cfg, 12);
  if (!s) s = train(x, 0);  // every rank: the plan is learned
  if (s) {
    result(name, false, "setup: " + status_text(s));
    return 1;
  }
  const int n = static_cast<int>(x.grads.size());
  if (g_rank == victim) {
    // Dies when rank 0 says so: by then its shadow of iteration 2 has launched every bucket, and those
    // that rank 0 holds back cannot complete without it.
    std::thread([] {
      int word = 0;
      MPI_Request req;
      MPI_Irecv(&word, 1, MPI_INT, 0, kKillTag, MPI_COMM_WORLD, &req);
      for (int got = 0; !got; usleep(1000)) MPI_Test(&req, &got, MPI_STATUS_IGNORE);
      std::fflush(stdout);
      raise(SIGKILL);
    }).detach();
    s = ddp_join(x.d, nullptr);
    result(std::string(name) + "-victim", false, "ddp_join returned before the kill -> " + status_text(s));
    leave_with(g_world - 1);
  }
  // Iteration 1: the victim shadows it, contributing zeros.
  s = train(x, 1);
  std::string why;
  auto gave = [victim](int r, int) { return r != victim; };
  const bool shadowed = s == DDP_SUCCESS && verify(x, 1, gave, &why);
  result(std::string(name) + "-shadowed", shadowed,
         "iteration 1 with rank " + std::to_string(victim) + " joined -> " + (s ? status_text(s) : why));
  double t0 = now_ms();
  const char* call = "ddp_join";
  if (g_rank == joined) {
    s = ddp_join(x.d, nullptr);
  } else {
    ddp_begin_backward(x.d, nullptr);
    fill(x, 2);
    for (int g = n - 1; g >= n / 2; --g) ddp_grad_ready(x.d, g);  // some buckets go out
    if (g_rank == 0) {
      const int word = 1;
      MPI_Send(&word, 1, MPI_INT, victim, kKillTag, MPI_COMM_WORLD);
      // The rest go out once the victim is dead: no rank completes a bucket of them.
      const double until = now_ms() + static_cast<double>(g_timeout_ms);
      while (!has_died(victim_pid) && now_ms() < until) usleep(1000);
    }
    for (int g = n / 2 - 1; g >= 0; --g) ddp_grad_ready(x.d, g);
    t0 = now_ms();
    call = "ddp_finish_backward";
    s = ddp_finish_backward(x.d, nullptr);
  }
  const double took = now_ms() - t0;
  const std::string msg = s ? ddp_last_error() : "";
  const bool ok = s == DDP_ERR_TIMEOUT && took <= g_timeout_ms + kMarginMs && took >= least_wait_ms(true) &&
                  msg.find("iteration 2") != std::string::npos && names_exactly(msg, "no answer from", victim);
  char b[160];
  std::snprintf(b, sizeof b, "%s after %.0f ms (timeout %lld) -> ", call, took, static_cast<long long>(g_timeout_ms));
  result(name, ok, b + status_text(s));
  if (g_rank == joined)
    check_aborted(name, [&] { return ddp_join(x.d, nullptr); });
  else
    check_aborted(name, [&] { return ddp_begin_backward(x.d, nullptr); });
  // A destroyed context answers no more, and would be named beside the dead rank: the survivors
  // destroy theirs once every survivor has asked where the others are (over Gloo one learns of the
  // death at once, another only at its timeout).
  meet("asked", g_world - 1);
  check_destroy(name, x.d);
  done();
  leave_with(g_world - 1);
}

// ---------------------------------------------------------------------------------------------
// Creation: ddp_create with a rank that never comes; a Gloo rank that dies in the rendezvous.
// ---------------------------------------------------------------------------------------------

int run_create_late() {
  const int victim = g_world - 1;
  if (g_rank == victim) {  // never creates; waits until the others have their results
    // (under a name of its own: a "done" mark of the victim's would let the others leave, and mpirun
    // end the job, before the victim printed its DONE)
    meet("created", g_world);
    done();
    leave_with(g_world);
  }
  ddp_config_t cfg = base_config();
  ddp_t d = nullptr;
  const double t0 = now_ms();
  const ddp_status_t s = ddp_create(g_comm, &cfg, &d);
  const double took = now_ms() - t0;
  char b[160];
  std::snprintf(b, sizeof b, "ddp_create after %.0f ms (timeout %lld) -> ", took, static_cast<long long>(g_timeout_ms));
  result("create-late",
         s == DDP_ERR_TIMEOUT && took >= 0.5 * static_cast<double>(g_timeout_ms) &&
             took <= static_cast<double>(g_timeout_ms) + kMarginMs,
         b + status_text(s));
  if (d) ddp_destroy(d);
  meet("created", 1);  // this rank's result is in
  done();
  leave_with(g_world);
}

// The victim of gloo-init-die dies right after the file store has published its addresses for the
// first communicator's mesh (the file "c0.<rank>"), before it connects: the store's rename, interposed
// here.
std::string g_die_after_key;

}  // namespace

extern "C" int rename(const char* from, const char* to) {
  const int rc = static_cast<int>(syscall(SYS_renameat, AT_FDCWD, from, AT_FDCWD, to));
  const char* base = std::strrchr(to, '/');
  if (!g_die_after_key.empty() && rc == 0 && base && g_die_after_key == base + 1) {
    std::fflush(stdout);
    raise(SIGKILL);
  }
  return rc;
}

namespace {

int run_gloo_init_die() {
  const char* dir = std::getenv("DDP_TEST_RUN_DIR");
  if (!g_gloo || !dir) {
    result("gloo-init-die", false, "needs DDP_TEST_GLOO and DDP_TEST_RUN_DIR");
    return 1;
  }
  const std::string store = std::string(dir) + "/store";
  mkdir(store.c_str(), 0700);
  MPI_Barrier(MPI_COMM_WORLD);
  if (g_rank == g_world - 1) g_die_after_key = "c0." + std::to_string(g_rank);
  const int64_t bound = g_timeout_ms;
  ddp_comm_t c = nullptr;
  const double t0 = now_ms();
  const ddp_status_t s = ddp_comm_init_gloo_timeout(("file://" + store).c_str(), g_rank, g_world, bound, &c);
  const double took = now_ms() - t0;
  char b[200];
  std::snprintf(b, sizeof b, "ddp_comm_init_gloo_timeout(%lld ms) after %.0f ms -> ", static_cast<long long>(bound),
                took);
  result("gloo-init-die", s == DDP_ERR_TIMEOUT && took <= static_cast<double>(bound) + 1000.0, b + status_text(s));
  done();
  leave_with(g_world - 1);
}

// ---------------------------------------------------------------------------------------------
// Leaving through exit(): without ddp_destroy, and after a timeout with a worker still blocked.
// ---------------------------------------------------------------------------------------------

[[noreturn]] void exit_with(int survivors) {
  std::fflush(stdout);
  meet("exit", survivors);
  std::exit(0);  // static destructors and atexit handlers (the library's MPI_Finalize) run
}

void run_exit_no_destroy() {
  Ctx x;
  ddp_status_t s = make_ctx(&x, base_config(), 12);
  for (int it = 0; !s && it < 2; ++it) {
    ddp_begin_backward(x.d, nullptr);
    fill(x, it);
    for (int g = static_cast<int>(x.grads.size()) - 1; g >= 0; --g) ddp_grad_ready(x.d, g);
    s = ddp_finish_backward(x.d, nullptr);
  }
  result("exit-no-destroy", s == DDP_SUCCESS, "two iterations -> " + status_text(s) + "; leaving without ddp_destroy");
  done();
  exit_with(g_world);
}

void run_exit_timeout() {
  const int victim = g_world - 1;
  ddp_t d = nullptr;
  int index = -1;
  one_big_bucket("exit-timeout", &d, &index);
  meet("warm", g_world);
  if (g_rank == victim) {
    usleep(300 * 1000);  // the others are inside the collective by now
    std::fflush(stdout);
    raise(SIGKILL);
  }
  ddp_begin_backward(d, nullptr);
  ddp_grad_ready(d, index);
  const ddp_status_t s = ddp_finish_backward(d, nullptr);
  result("exit-timeout", s == DDP_ERR_TIMEOUT || s == DDP_ERR_ABORTED, "finish -> " + status_text(s));
  if (g_rank == 0) ddp_destroy(d);
  done();
  exit_with(g_world - 1);
}

}  // namespace

// The exit-* scenarios: over MPI the library initializes MPI itself (ddp_comm_init_mpi before any MPI
// call), so that its own MPI_Finalize runs at exit; over Gloo no MPI at all (mpirun only starts the
// ranks: rank and size from its environment).
int run_exit(const std::string& scenario, const char* gloo) {
  ddp_status_t s;
  if (gloo) {
    const char* r = std::getenv("OMPI_COMM_WORLD_RANK");
    const char* n = std::getenv("OMPI_COMM_WORLD_SIZE");
    g_rank = r ? std::atoi(r) : 0;
    g_world = n ? std::atoi(n) : 1;
    s = ddp_comm_init_gloo_timeout(gloo, g_rank, g_world, 60000, &g_comm);
  } else {
    s = ddp_comm_init_mpi(nullptr, &g_comm);
    if (!s) {
      MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
      MPI_Comm_size(MPI_COMM_WORLD, &g_world);
    }
  }
  if (s) {
    result(scenario, false, "creating the communicator -> " + status_text(s));
    return 1;
  }
  if (scenario == "exit-no-destroy") run_exit_no_destroy();
  if (scenario == "exit-timeout") run_exit_timeout();
  result(scenario, false, "unknown scenario");
  return 2;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: faults die-exit|die-kill|stall|mismatch|unused|nonfinite|threads|blocked|inspect-kill|"
                 "inspect-stall|inspect-skip|inspect-slow|shard-kill|shard-stall|gather-kill|gather-stall|join-kill|"
                 "create-late|gloo-init-die|exit-no-destroy|exit-timeout [seed] "
                 "[timeout_ms]\n");
    return 2;
  }
  const std::string scenario = argv[1];
  if (argc > 2) g_seed = std::strtoull(argv[2], nullptr, 10);
  if (argc > 3) g_timeout_ms = std::strtoll(argv[3], nullptr, 10);
  const char* gloo = std::getenv("DDP_TEST_GLOO");
  g_gloo = gloo != nullptr;
  if (scenario.compare(0, 5, "exit-") == 0) return run_exit(scenario, gloo);
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_world);
  if (scenario == "gloo-init-die") return run_gloo_init_die();
  ddp_status_t s =
      g_gloo ? ddp_comm_init_gloo_timeout(gloo, g_rank, g_world, 60000, &g_comm) : ddp_comm_init_mpi(nullptr, &g_comm);
  if (s) {
    result(scenario, false, std::string(g_gloo ? "ddp_comm_init_gloo" : "ddp_comm_init_mpi") + " -> " + status_text(s));
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  int rc = 0;
  if (scenario == "create-late")
    rc = run_create_late();
  else if (scenario == "die-exit")
    rc = run_fault(Fault::Exit, "die-exit");
  else if (scenario == "die-kill")
    rc = run_fault(Fault::Kill, "die-kill");
  else if (scenario == "stall")
    rc = run_fault(Fault::Stall, "stall");
  else if (scenario == "mismatch")
    run_mismatch();
  else if (scenario == "unused")
    run_unused();
  else if (scenario == "nonfinite")
    run_nonfinite();
  else if (scenario == "threads")
    run_threads();
  else if (scenario == "blocked")
    run_blocked();
  else if (scenario == "shard-kill")
    rc = run_fault(Fault::Kill, "shard-kill", true);
  else if (scenario == "shard-stall")
    rc = run_fault(Fault::Stall, "shard-stall", true);
  else if (scenario == "gather-kill")
    rc = run_gather_fault(Fault::Kill, "gather-kill");
  else if (scenario == "gather-stall")
    rc = run_gather_fault(Fault::Stall, "gather-stall");
  else if (scenario == "join-kill")
    rc = run_join_kill();
  else if (scenario.compare(0, 8, "inspect-") == 0)
    rc = run_inspect(scenario);
  else {
    result(scenario, false, "unknown scenario");
    rc = 2;
  }
  if (scenario.compare(0, 4, "die-") != 0 && scenario != "stall" && scenario != "shard-stall") done();
  ddp_comm_destroy(g_comm);
  MPI_Finalize();
  return rc;
}
