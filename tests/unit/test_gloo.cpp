// The Gloo communicator inside one process: every bad init method and argument with its status and
// message, a rendezvous that a rank never joins (bounded, naming the rank), and ranks as threads that
// meet over tcp:// and file:// and reduce exactly. The rendezvous's arrival (host/rendezvous.hpp), ranks as
// threads each given its job id: ranks of two jobs at one address, a rank number claimed twice,
// WORLD_SIZE that differs between ranks, a rank beyond the world, ports out of range, the progress
// line while a rank is missing; and how Gloo's exceptions are reported. Multi-process runs are in
// tests/gloo.
#include <doctest.h>

#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backends/gloo/gloo_errors.hpp"
#include "core/common.hpp"
#include "ddp.h"
#include "host/rendezvous.hpp"
#include "../support/ports.hpp"

#ifdef DDP_TEST_HAVE_GLOO
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#endif

namespace {

bool have_gloo() {
  ddp_comm_t c = nullptr;
  const ddp_status_t s = ddp_comm_init_gloo("bogus://", 0, 1, &c);
  return s != DDP_ERR_UNSUPPORTED;
}

using ddp_test::free_port;

std::string tcp_method() { return "tcp://127.0.0.1:" + std::to_string(free_port()); }

void expect(ddp_status_t got, ddp_status_t want, const char* needle) {
  CHECK(got == want);
  if (needle) {
    const std::string msg = ddp_last_error();
    INFO("message: " << msg);
    CHECK(msg.find(needle) != std::string::npos);
  }
}

// Each of `n` threads makes rank r's comm over `method` and runs fn(r, comm); returns the failures.
template <class F>
int on_gloo_ranks(int n, const std::string& method, F fn) {
  std::atomic<int> failed{0};
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      ddp_comm_t c = nullptr;
      if (ddp_comm_init_gloo_timeout(method.c_str(), r, n, 20000, &c) != DDP_SUCCESS) {
        MESSAGE("rank " << r << ": " << std::string(ddp_last_error()));
        ++failed;
        return;
      }
      if (!fn(r, c)) ++failed;
      ddp_comm_destroy(c);
    });
  for (auto& t : ts) t.join();
  return failed.load();
}

// Two grads of known values reduced over the comm: the average of 1..n times the element index.
bool reduce_known(int rank, ddp_comm_t comm) {
  int world = 0;
  ddp_comm_size(comm, &world);
  ddp_config_t cfg;
  ddp_config_init(&cfg);
  cfg.timeout_ms = 20000;
  cfg.message_size = 3000;
  ddp_t d = nullptr;
  if (ddp_create(comm, &cfg, &d) != DDP_SUCCESS) return false;
  std::vector<float> a(70000);  // the ring
  std::vector<double> b(5);     // the small path
  int ia = -1, ib = -1;
  bool ok = ddp_register_grad(d, a.data(), a.size(), DDP_F32, 0, &ia) == DDP_SUCCESS &&
            ddp_register_grad(d, b.data(), b.size(), DDP_F64, 0, &ib) == DDP_SUCCESS;
  for (int it = 0; ok && it < 3; ++it) {
    for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>((rank + 1) * static_cast<int>(i % 1000));
    for (size_t i = 0; i < b.size(); ++i) b[i] = (rank + 1) * 0.25 * static_cast<double>(i);
    ok = ddp_begin_backward(d, nullptr) == DDP_SUCCESS && ddp_grad_ready(d, rank % 2 ? ia : ib) == DDP_SUCCESS &&
         ddp_grad_ready(d, rank % 2 ? ib : ia) == DDP_SUCCESS && ddp_finish_backward(d, nullptr) == DDP_SUCCESS;
    const double mean = (world + 1) / 2.0;  // of 1..world
    for (size_t i = 0; ok && i < a.size(); ++i) ok = a[i] == static_cast<float>(mean * static_cast<double>(i % 1000));
    for (size_t i = 0; ok && i < b.size(); ++i) ok = b[i] == mean * 0.25 * static_cast<double>(i);
  }
  if (!ok) MESSAGE("rank " << rank << ": " << std::string(ddp_last_error()));
  ddp_destroy(d);
  return ok;
}

struct EnvGuard {  // restores the variables a test changes
  std::vector<std::pair<std::string, std::string>> saved;
  void set(const char* k, const char* v) {
    const char* old = std::getenv(k);
    saved.emplace_back(k, old ? old : std::string("\x01"));
    if (v)
      setenv(k, v, 1);
    else
      unsetenv(k);
  }
  ~EnvGuard() {
    for (auto it = saved.rbegin(); it != saved.rend(); ++it) {
      if (it->second == "\x01")
        unsetenv(it->first.c_str());
      else
        setenv(it->first.c_str(), it->second.c_str(), 1);
    }
  }
};

// One rank's arrival on a thread: its status and message once it returns.
struct Rank {
  ddp_status_t status = DDP_SUCCESS;
  std::string message;
  double seconds = 0;
  ddp::Rendezvous rv;  // kept until the test is done with every rank (rank 0's store serves them)
  std::thread t;
  Rank(const std::string& method, int rank, int size, const std::string& job, int64_t timeout_ms = 10000) {
    t = std::thread([=] {
      const auto t0 = std::chrono::steady_clock::now();
      try {
        rv = ddp::open_rendezvous(method.c_str(), rank, size, ddp::Deadline::after_ms(timeout_ms), job);
      } catch (const ddp::Error& e) {
        status = e.status();
        message = e.what();
      }
      seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
  }
  void join() {
    if (t.joinable()) t.join();
  }
  ~Rank() { join(); }
};

void expect_rank(const Rank& r, ddp_status_t want, std::vector<std::string> needles) {
  INFO("message: " << r.message);
  CHECK(r.status == want);
  for (const std::string& n : needles) CHECK(r.message.find(n) != std::string::npos);
}

std::mutex g_log_mu;
std::vector<std::string> g_logged;

struct LogScope {  // collects the log while it lives
  LogScope() {
    g_logged.clear();
    ddp_set_log_callback(
        [](ddp_log_level_t level, const char* m, void*) {
          std::lock_guard<std::mutex> lock(g_log_mu);
          g_logged.push_back(std::string(level == DDP_LOG_WARN ? "W " : "I ") + m);
        },
        nullptr);
  }
  ~LogScope() { ddp_set_log_callback(nullptr, nullptr); }
  static std::string find(const std::string& needle) {
    std::lock_guard<std::mutex> lock(g_log_mu);
    for (const std::string& l : g_logged)
      if (l.find(needle) != std::string::npos) return l;
    return "";
  }
};

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

}  // namespace

TEST_CASE("gloo: bad init methods and arguments are refused, saying why") {
  ddp_comm_t c = nullptr;
  if (!have_gloo()) {
    expect(ddp_comm_init_gloo("env://", 0, 1, &c), DDP_ERR_UNSUPPORTED, "without Gloo");
    return;
  }
  expect(ddp_comm_init_gloo("bogus://x", 0, 1, &c), DDP_ERR_INVALID_ARGUMENT, "unknown init method 'bogus://x'");
  expect(ddp_comm_init_gloo("tcp://nohost", 0, 1, &c), DDP_ERR_INVALID_ARGUMENT, "expected tcp://HOST:PORT");
  expect(ddp_comm_init_gloo("tcp://127.0.0.1:port", 0, 1, &c), DDP_ERR_INVALID_ARGUMENT,
         "the port 'port' is not a port: expected an integer in 1..65535");
  expect(ddp_comm_init_gloo("file:///no/such/dir", 0, 1, &c), DDP_ERR_INVALID_ARGUMENT, "is not a directory");
  expect(ddp_comm_init_gloo("env://", 2, 2, &c), DDP_ERR_INVALID_ARGUMENT, "rank 2 out of range 0..1");
  expect(ddp_comm_init_gloo("env://", 0, 0, &c), DDP_ERR_INVALID_ARGUMENT, "size is 0");
  expect(ddp_comm_init_gloo("env://", -2, 1, &c), DDP_ERR_INVALID_ARGUMENT, "rank is -2");
  expect(ddp_comm_init_gloo("env://", 0, 1, nullptr), DDP_ERR_INVALID_ARGUMENT, "comm");
  expect(ddp_comm_init_gloo_timeout("env://", 0, 1, -5, &c), DDP_ERR_INVALID_ARGUMENT, "timeout_ms is -5");
  CHECK(c == nullptr);
  {
    EnvGuard env;
    env.set("MASTER_ADDR", nullptr);
    env.set("RANK", nullptr);
    env.set("WORLD_SIZE", nullptr);
    expect(ddp_comm_init_gloo("env://", 0, 1, &c), DDP_ERR_INVALID_ARGUMENT, "MASTER_ADDR is not set");
    // Without RANK or WORLD_SIZE, env:// is auto (tests/unit/test_launcher_env.cpp), which finds no launcher here.
    expect(ddp_comm_init_gloo(nullptr, -1, 1, &c), DDP_ERR_INVALID_ARGUMENT,
           "env:// (without RANK and WORLD_SIZE: as auto): init method auto: no launcher's variables");
    expect(ddp_comm_init_gloo(nullptr, 0, -1, &c), DDP_ERR_INVALID_ARGUMENT,
           "env:// (without RANK and WORLD_SIZE: as auto): init method auto: no launcher's variables");
    env.set("MASTER_ADDR", "127.0.0.1");
    env.set("MASTER_PORT", nullptr);
    expect(ddp_comm_init_gloo(nullptr, 0, 1, &c), DDP_ERR_INVALID_ARGUMENT, "MASTER_PORT is not set");
    env.set("MASTER_PORT", "29500");
    env.set("DDP_STORE_PORT", "x");
    expect(ddp_comm_init_gloo(nullptr, 0, 1, &c), DDP_ERR_INVALID_ARGUMENT, "DDP_STORE_PORT='x'");
  }
  // A port that is taken: rank 0 cannot listen there.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  socklen_t len = sizeof a;
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  listen(fd, 1);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const std::string taken = "tcp://127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  expect(ddp_comm_init_gloo_timeout(taken.c_str(), 0, 2, 2000, &c), DDP_ERR_INVALID_ARGUMENT, "cannot listen on port");
  close(fd);
}

TEST_CASE("gloo: a rank that never joins makes the others time out, naming it") {
  if (!have_gloo()) return;
  ddp_comm_t c = nullptr;
  auto t0 = std::chrono::steady_clock::now();
  expect(ddp_comm_init_gloo_timeout(tcp_method().c_str(), 0, 2, 500, &c), DDP_ERR_TIMEOUT, "rank 1 never arrived");
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  CHECK(ms >= 400);
  CHECK(ms < 3000);
  // A non-zero rank whose rank 0 never listens.
  expect(ddp_comm_init_gloo_timeout(tcp_method().c_str(), 1, 2, 300, &c), DDP_ERR_TIMEOUT, "nobody listened");
  char dir[] = "/tmp/ddp_gloo_XXXXXX";
  REQUIRE(mkdtemp(dir));
  const std::string file = std::string("file://") + dir;
  expect(ddp_comm_init_gloo_timeout(file.c_str(), 1, 3, 300, &c), DDP_ERR_TIMEOUT, "never arrived");
  CHECK(c == nullptr);
  std::system((std::string("rm -rf ") + dir).c_str());
}

TEST_CASE("gloo: ranks as threads meet over tcp:// and reduce exactly") {
  if (!have_gloo()) return;
  for (int n : {1, 2, 3}) {
    INFO("ranks " << n);
    CHECK(on_gloo_ranks(n, tcp_method(), [](int r, ddp_comm_t c) {
            int rank = -1, size = -1;
            ddp_comm_rank(c, &rank);
            ddp_comm_size(c, &size);
            return rank == r && reduce_known(r, c);
          }) == 0);
  }
}

TEST_CASE("gloo: arguments that differ between ranks are DDP_ERR_MISMATCH on every rank, not Gloo's abort") {
  if (!have_gloo()) return;
  // A root's broadcast larger than a receiver's buffer, or allreduces of different sizes, would end the
  // process inside Gloo's transport (its failed size check throws on its own thread).
  CHECK(on_gloo_ranks(2, tcp_method(), [](int r, ddp_comm_t c) {
          ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
          cfg.timeout_ms = 20000;
          ddp_t d = nullptr;
          if (ddp_create(c, &cfg, &d) != DDP_SUCCESS) return false;
          std::vector<float> b(r == 0 ? 64 : 4, static_cast<float>(r + 1));
          void* bufs[1] = {b.data()};
          const size_t counts[1] = {b.size()};
          const ddp_dtype_t dtypes[1] = {DDP_F32};
          expect(ddp_broadcast(d, bufs, counts, dtypes, 1, 0, nullptr), DDP_ERR_MISMATCH,
                 "buffer 0 is 64 elements of f32 on rank 0 but 4 elements of f32 on rank 1");
          ddp_destroy(d);
          std::vector<double> x(r == 0 ? 100000 : 10, 1.0);
          expect(ddp_comm_allreduce(c, x.data(), x.size(), DDP_F64, DDP_OP_SUM, nullptr), DDP_ERR_MISMATCH,
                 "100000 elements of f64 (sum)");
          // The comm itself is still usable: the comparison came before any data.
          expect(ddp_comm_allreduce(c, x.data(), 10, DDP_F64, DDP_OP_SUM, nullptr), DDP_SUCCESS, nullptr);
          return x[0] == 2.0;
        }) == 0);
}

TEST_CASE("gloo: ranks meet over file:// and leave the directory empty") {
  if (!have_gloo()) return;
  char dir[] = "/tmp/ddp_gloo_XXXXXX";
  REQUIRE(mkdtemp(dir));
  const std::string file = std::string("file://") + dir;
  CHECK(on_gloo_ranks(2, file, [](int r, ddp_comm_t c) { return reduce_known(r, c); }) == 0);
  int entries = 0;
  if (DIR* d = opendir(dir)) {
    while (dirent* e = readdir(d))
      if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..")) ++entries;
    closedir(d);
  }
  CHECK(entries == 0);
  rmdir(dir);
}

TEST_CASE("gloo: env:// reads the launcher's variables; a second comm meets over the same store") {
  if (!have_gloo()) return;
  EnvGuard env;
  const std::string port = std::to_string(free_port());
  env.set("MASTER_ADDR", "127.0.0.1");
  env.set("MASTER_PORT", "1");  // DDP_STORE_PORT wins
  env.set("DDP_STORE_PORT", port.c_str());
  env.set("RANK", "0");
  env.set("WORLD_SIZE", "1");
  ddp_comm_t a = nullptr, b = nullptr;
  REQUIRE(ddp_comm_init_gloo(nullptr, -1, -1, &a) == DDP_SUCCESS);
  REQUIRE(ddp_comm_init_gloo("env://", -1, -1, &b) == DDP_SUCCESS);
  int size = 0;
  ddp_comm_size(b, &size);
  CHECK(size == 1);
  CHECK(reduce_known(0, a));
  ddp_comm_destroy(a);
  ddp_comm_destroy(b);
}

TEST_CASE("rendezvous: a rank of another job at the same address is refused by name; the job goes on") {
  LogScope log;
  for (const std::string& method : {tcp_method(), std::string()}) {
    std::string m = method, dir;
    if (m.empty()) {
      char d[] = "/tmp/ddp_rv_XXXXXX";
      REQUIRE(mkdtemp(d));
      dir = d;
      m = "file://" + dir;
    }
    INFO("method " << m);
    Rank r0(m, 0, 2, "jobB");
    Rank stray(m, 1, 2, "jobA");  // job A's rank 1, started by hand on job B's port
    stray.join();
    expect_rank(stray, DDP_ERR_MISMATCH,
                {"rank 1 (job 'jobA', WORLD_SIZE=2, host ", "belongs to job 'jobB'", "refused"});
    Rank r1(m, 1, 2, "jobB");
    r0.join();
    r1.join();
    expect_rank(r0, DDP_SUCCESS, {});
    expect_rank(r1, DDP_SUCCESS, {});
    CHECK(LogScope::find("a rank of another job was turned away: rank 1 (job 'jobA'") != "");
    if (!dir.empty()) std::system(("rm -rf " + dir).c_str());
  }
  // A rank with no job id at a job's store, and the other way round.
  const std::string m = tcp_method();
  Rank r0(m, 0, 2, "");
  Rank stray(m, 1, 2, "jobA");
  stray.join();
  expect_rank(stray, DDP_ERR_MISMATCH, {"job 'jobA'", "belongs to no job id"});
  Rank r1(m, 1, 2, "");
  r0.join();
  r1.join();
  expect_rank(r0, DDP_SUCCESS, {});
}

TEST_CASE("rendezvous: a rank number claimed twice is refused on every rank, naming both processes") {
  const std::string m = tcp_method();
  Rank r0(m, 0, 3, "j");
  Rank first(m, 1, 3, "j");
  sleep_ms(300);  // rank 1 has arrived; rank 2 never does
  Rank second(m, 1, 3, "j");
  for (Rank* r : {&r0, &first, &second}) {
    r->join();
    expect_rank(*r, DDP_ERR_MISMATCH,
                {"rank 1 is claimed twice: by rank 1 (job 'j', WORLD_SIZE=3", "which arrived first"});
    CHECK(r->seconds < 5);  // at once, not at the 10 s bound
  }
  CHECK(second.message.find("the rendezvous is refused on every rank") == std::string::npos);
  CHECK(r0.message.find("the rendezvous is refused on every rank") != std::string::npos);
  // Rank 0 twice in one directory (a file store has no listener to refuse the second).
  char d[] = "/tmp/ddp_rv_XXXXXX";
  REQUIRE(mkdtemp(d));
  const std::string f = std::string("file://") + d;
  Rank a(f, 0, 2, "j");
  sleep_ms(200);
  Rank b(f, 0, 2, "j");
  b.join();
  expect_rank(b, DDP_ERR_MISMATCH, {"rank 0 is claimed twice"});
  Rank c(f, 1, 2, "j");
  a.join();
  c.join();
  expect_rank(a, DDP_SUCCESS, {});
  std::system((std::string("rm -rf ") + d).c_str());
}

TEST_CASE("rendezvous: WORLD_SIZE that differs between ranks is refused at once, naming each rank's") {
  const std::string m = tcp_method();
  Rank r0(m, 0, 3, "j");
  Rank r1(m, 1, 2, "j");
  for (Rank* r : {&r0, &r1}) {
    r->join();
    expect_rank(*r, DDP_ERR_MISMATCH,
                {"WORLD_SIZE differs between ranks: rank 0 has WORLD_SIZE=3", "rank 1 has WORLD_SIZE=2"});
    CHECK(r->seconds < 5);
  }
  // A rank beyond rank 0's world.
  const std::string m2 = tcp_method();
  Rank s0(m2, 0, 2, "j");
  Rank s3(m2, 3, 4, "j");
  for (Rank* r : {&s0, &s3}) {
    r->join();
    expect_rank(*r, DDP_ERR_MISMATCH, {"rank 3 has WORLD_SIZE=4", "a rank beyond rank 0's world of 2"});
    CHECK(r->seconds < 5);
  }
}

TEST_CASE("rendezvous: WORLD_SIZE mismatch through ddp_comm_init_gloo is DDP_ERR_MISMATCH, not Gloo's timeout") {
  ddp_comm_t probe = nullptr;
  if (ddp_comm_init_gloo("bogus://", 0, 1, &probe) == DDP_ERR_UNSUPPORTED) return;
  const std::string m = tcp_method();
  ddp_status_t s0 = DDP_SUCCESS, s1 = DDP_SUCCESS;
  std::string m0, m1;
  std::thread a([&] {
    ddp_comm_t c = nullptr;
    s0 = ddp_comm_init_gloo_timeout(m.c_str(), 0, 3, 10000, &c);
    m0 = ddp_last_error();
  });
  std::thread b([&] {
    ddp_comm_t c = nullptr;
    s1 = ddp_comm_init_gloo_timeout(m.c_str(), 1, 2, 10000, &c);
    m1 = ddp_last_error();
  });
  a.join();
  b.join();
  INFO(m0 << " | " << m1);
  CHECK(s0 == DDP_ERR_MISMATCH);
  CHECK(s1 == DDP_ERR_MISMATCH);
  CHECK(m1.find("rank 0 has WORLD_SIZE=3") != std::string::npos);
  CHECK(m1.find("rank 1 has WORLD_SIZE=2") != std::string::npos);
}

TEST_CASE("rendezvous: ports out of range are refused at once, naming the variable or method and the range") {
  ddp_comm_t c = nullptr;
  if (ddp_comm_init_gloo("bogus://", 0, 1, &c) == DDP_ERR_UNSUPPORTED) return;
  auto quick = [&](const char* method, const char* needle) {
    const auto t0 = std::chrono::steady_clock::now();
    const ddp_status_t s = ddp_comm_init_gloo_timeout(method, 1, 2, 5000, &c);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::string msg = ddp_last_error();
    INFO(method << ": " << msg);
    CHECK(s == DDP_ERR_INVALID_ARGUMENT);
    CHECK(msg.find(needle) != std::string::npos);
    CHECK(secs < 1);
  };
  for (const char* p : {"70000", "0", "-1", "abc", "65536", ""}) {
    const std::string m = std::string("tcp://127.0.0.1:") + p;
    quick(m.c_str(), (std::string("the port '") + p + "' is not a port: expected an integer in 1..65535").c_str());
  }
  EnvGuard env;
  env.set("MASTER_ADDR", "127.0.0.1");
  env.set("DDP_STORE_PORT", nullptr);
  for (const char* p : {"70000", "0", "-1", "abc", "65536"}) {
    env.set("MASTER_PORT", p);
    quick("env://", (std::string("MASTER_PORT='") + p + "' is not a port: expected an integer in 1..65535").c_str());
  }
  env.set("MASTER_PORT", "65535");  // the store's port would be 65536
  quick("env://", "MASTER_PORT=65535: the env:// store listens on MASTER_PORT + 1 = 65536, outside 1..65535");
  env.set("DDP_STORE_PORT", "65536");
  quick("env://", "DDP_STORE_PORT='65536' is not a port (1..65535)");
  env.set("DDP_STORE_PORT", "0");
  quick("env://", "DDP_STORE_PORT='0' is not a port (1..65535)");
}

TEST_CASE("rendezvous: while a rank is missing, rank 0 says who arrived and who did not, through the log") {
  EnvGuard env;
  env.set("DDP_INIT_PROGRESS_MS", "150");
  LogScope log;
  const std::string m = tcp_method();
  Rank r0(m, 0, 4, "j", 900);
  Rank r1(m, 1, 4, "j", 900);
  Rank r3(m, 3, 4, "j", 900);
  r0.join();
  r1.join();
  r3.join();
  expect_rank(r0, DDP_ERR_TIMEOUT, {"rank 2 never arrived (3 of 4 arrived)"});
  expect_rank(r1, DDP_ERR_TIMEOUT, {});
  const std::string line = LogScope::find("waiting for ranks at " + m + ": 3 of 4 arrived; missing rank 2 (waited ");
  INFO("log: " << (g_logged.empty() ? std::string("(nothing)") : g_logged.back()));
  CHECK(line.rfind("W ", 0) == 0);  // a warning: printed by default
  CHECK(line.find(" of 0.9 s)") != std::string::npos);
  // Off with 0.
  env.set("DDP_INIT_PROGRESS_MS", "0");
  g_logged.clear();
  Rank q(tcp_method(), 0, 2, "j", 400);
  q.join();
  CHECK(LogScope::find("waiting for ranks") == "");
}

TEST_CASE("gloo: Gloo's failed checks are not reported as timeouts") {
#ifdef DDP_TEST_HAVE_GLOO
  auto status_of = [](auto thrown, std::string* msg) {
    try {
      try {
        throw thrown;
      } catch (...) {
        ddp::rethrow_gloo_failure(1, 3, "all-gather");
      }
    } catch (const ddp::Error& e) {
      *msg = e.what();
      return e.status();
    }
    return DDP_SUCCESS;
  };
  std::string msg;
  CHECK(status_of(gloo::EnforceNotMet("address.cc", 45, "sizeof(impl_) == bytes.size()", "136 vs 68"), &msg) ==
        DDP_ERR_MISMATCH);
  CHECK(msg.find("rank 1 of 3: Gloo all-gather failed a consistency check") != std::string::npos);
  CHECK(msg.find("136 vs 68") != std::string::npos);
  CHECK(status_of(gloo::IoException("Timed out waiting 1000ms for recv operation"), &msg) == DDP_ERR_TIMEOUT);
  CHECK(msg.find("Timed out waiting") != std::string::npos);
  // The transport's check on a socket closed under it (a peer died while this rank posted to it).
  CHECK(status_of(gloo::EnforceNotMet("loop.cc", 68, "rv != -1", "-1 vs -1. epoll_ctl: Bad file descriptor"), &msg) ==
        DDP_ERR_TIMEOUT);
  CHECK(msg.find("a peer's connection closed under it") != std::string::npos);
  CHECK(status_of(std::runtime_error("odd"), &msg) == DDP_ERR_INTERNAL);
  CHECK(msg.find("rank 1 of 3: Gloo all-gather failed: odd") != std::string::npos);
#endif
}

// A file store of its own and an elastic config, for the join tests; the store removed at the end.
struct JoinScene {
  std::string dir, method;
  ddp_config_t cfg;
  JoinScene() {
    char tmpl[] = "/tmp/ddp-join-XXXXXX";
    dir = mkdtemp(tmpl);
    method = "file://" + dir;
    ddp_config_init(&cfg);
    cfg.elastic = 1;
    cfg.timeout_ms = 20000;
  }
  ~JoinScene() { std::system(("rm -rf " + dir).c_str()); }
};

// Elastic joins inside one process: two ranks (threads) train over file://; a joiner whose grads
// differ is refused with the job's reason and may ask again; once it registers the job's grads it
// is admitted at a step boundary, takes the state of membership.source and reduces with the others.
TEST_CASE("elastic joins: a joiner is refused by reason, asks again, is admitted and reduces with the job") {
  if (!have_gloo()) return;
  const JoinScene scene;
  const std::string& method = scene.method;
  ddp_config_t cfg = scene.cfg;
  const size_t na = 3000, nb = 7;
  std::atomic<bool> joined{false};
  std::vector<std::string> errors;
  std::mutex mu;
  auto complain = [&](const std::string& who) {
    std::lock_guard<std::mutex> lock(mu);
    errors.push_back(who + ": " + ddp_last_error());
  };
  // The job: rank r's grads hold r + 1 (the joiner's 10); the mean is checked each step.
  auto rank_run = [&](int r) {
    ddp_comm_t c = nullptr;
    if (ddp_comm_init_gloo_timeout(method.c_str(), r, 2, 20000, &c) != DDP_SUCCESS) return complain("init");
    ddp_t d = nullptr;
    std::vector<float> a(na), b(nb);
    int ia = 0, ib = 0;
    if (ddp_create(c, &cfg, &d) != DDP_SUCCESS || ddp_register_grad(d, a.data(), na, DDP_F32, 0, &ia) ||
        ddp_register_grad(d, b.data(), nb, DDP_F32, 0, &ib))
      return complain("create");
    // Nothing lost and nobody waiting: nothing to recover (the job is not disturbed).
    expect(ddp_recover(d, nullptr, nullptr, 0), DDP_ERR_INVALID_STATE, "no rank was lost and none waits to join");
    int world = 2, rank = r, steps_after = 0;
    float state = 0;  // stands for the model: the joiner must receive it
    for (int it = 0; it < 1500 && steps_after < 5; ++it) {
      std::fill(a.begin(), a.end(), static_cast<float>(r + 1));
      std::fill(b.begin(), b.end(), static_cast<float>(r + 1));
      ddp_status_t st = ddp_begin_backward(d, nullptr);
      if (st == DDP_ERR_RANK_JOINING) {
        CHECK(std::string(ddp_last_error()).find("asked to join the job and waits at this step boundary") !=
              std::string::npos);
        ddp_membership_t m;
        int members[3] = {9, 9, 9};
        if (ddp_recover(d, &m, members, 3) != DDP_SUCCESS) return complain("recover");
        CHECK(m.world == 3);
        CHECK(m.rank == r);
        CHECK(m.old_world == 2);
        CHECK(m.source == 0);
        CHECK(members[0] == 0);
        CHECK(members[1] == 1);
        CHECK(members[2] == -1);
        void* buf = &state;
        const size_t one = 1;
        const ddp_dtype_t f32 = DDP_F32;
        if (ddp_broadcast(d, &buf, &one, &f32, 1, m.source, nullptr) != DDP_SUCCESS) return complain("broadcast");
        world = m.world, rank = m.rank;
        continue;
      }
      if (st != DDP_SUCCESS || ddp_grad_ready(d, ib) || ddp_grad_ready(d, ia) || ddp_finish_backward(d, nullptr))
        return complain("step");
      state += 1;
      const float want = world == 3 ? 13.0f / 3 : 1.5f;
      CHECK(a[0] == want);
      CHECK(b[nb - 1] == want);
      if (world == 3) ++steps_after;
      std::this_thread::sleep_for(std::chrono::milliseconds(world == 3 ? 0 : 10));
    }
    CHECK(world == 3);
    CHECK(rank == r);
    ddp_destroy(d);
    ddp_comm_destroy(c);
  };
  auto joiner_run = [&] {
    ddp_comm_t c = nullptr;
    if (ddp_comm_join_gloo(method.c_str(), 20000, &c) != DDP_SUCCESS) return complain("join comm");
    int rank = 0;
    expect(ddp_comm_rank(c, &rank), DDP_ERR_INVALID_STATE, "has no rank until the job admits it");
    ddp_config_t plain;
    ddp_config_init(&plain);
    ddp_t d = nullptr;
    expect(ddp_create(c, &plain, &d), DDP_ERR_INVALID_ARGUMENT, "needs config.elastic");
    if (ddp_create(c, &cfg, &d) != DDP_SUCCESS) return complain("create");
    expect(ddp_recover(d, nullptr, nullptr, 0), DDP_ERR_INVALID_STATE, "register the grads before ddp_recover");
    std::vector<float> a(na), b(nb);
    int ia = 0, ib = 0;
    if (ddp_register_grad(d, a.data(), na, DDP_F32, 0, &ia)) return complain("register");
    expect(ddp_begin_backward(d, nullptr), DDP_ERR_RANK_JOINING, "call ddp_recover to be admitted");
    expect(ddp_commit(d), DDP_ERR_RANK_JOINING, "joins a running job");
    ddp_stats_t stats;
    stats.size = sizeof stats;
    CHECK(ddp_get_stats(d, &stats) == DDP_SUCCESS);  // answers before the admission too
    CHECK(stats.iterations == 0);
    // One grad where the job has two: refused with the job's reason, and still a joiner.
    expect(ddp_recover(d, nullptr, nullptr, 0), DDP_ERR_MISMATCH, "registered 1 grads, the job 2");
    if (ddp_register_grad(d, b.data(), nb, DDP_F32, 0, &ib)) return complain("register again");
    ddp_membership_t m;
    if (ddp_recover(d, &m, nullptr, 0) != DDP_SUCCESS) return complain("admission");
    CHECK(m.world == 3);
    CHECK(m.rank == 2);
    CHECK(m.old_rank == -1);
    CHECK(m.old_world == 2);
    CHECK(m.behind == 1);
    CHECK(m.epoch == 1);
    CHECK(m.committed > 0);
    float state = -1;
    void* buf = &state;
    const size_t one = 1;
    const ddp_dtype_t f32 = DDP_F32;
    if (ddp_broadcast(d, &buf, &one, &f32, 1, m.source, nullptr) != DDP_SUCCESS) return complain("broadcast");
    CHECK(state == static_cast<float>(m.committed));  // the job's state: one per committed step
    joined = true;
    for (int it = 0; it < 5; ++it) {
      std::fill(a.begin(), a.end(), 10.0f);
      std::fill(b.begin(), b.end(), 10.0f);
      if (ddp_begin_backward(d, nullptr) || ddp_grad_ready(d, ia) || ddp_grad_ready(d, ib) ||
          ddp_finish_backward(d, nullptr))
        return complain("joiner step");
      CHECK(a[0] == 13.0f / 3);
    }
    ddp_destroy(d);
    ddp_comm_destroy(c);
  };
  std::thread r0(rank_run, 0), r1(rank_run, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  std::thread j(joiner_run);
  r0.join();
  r1.join();
  j.join();
  for (const std::string& e : errors) MESSAGE(e);
  CHECK(errors.empty());
  CHECK(joined.load());
}

TEST_CASE("elastic joins: a joiner that no job admits times out, saying what it waited for") {
  if (!have_gloo()) return;
  char tmpl[] = "/tmp/ddp-join-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  ddp_comm_t c = nullptr;
  REQUIRE(ddp_comm_join_gloo(("file://" + dir).c_str(), 300, &c) == DDP_SUCCESS);
  ddp_config_t cfg;
  ddp_config_init(&cfg);
  cfg.elastic = 1;
  ddp_t d = nullptr;
  REQUIRE(ddp_create(c, &cfg, &d) == DDP_SUCCESS);
  std::vector<float> g(10);
  int i = 0;
  REQUIRE(ddp_register_grad(d, g.data(), g.size(), DDP_F32, 0, &i) == DDP_SUCCESS);
  expect(ddp_recover(d, nullptr, nullptr, 0), DDP_ERR_TIMEOUT, "no running elastic job at file://");
  expect(ddp_recover(d, nullptr, nullptr, 0), DDP_ERR_TIMEOUT, "admitted this process before the timeout");
  ddp_destroy(d);
  ddp_comm_destroy(c);
  expect(ddp_comm_join_gloo(nullptr, 100, nullptr), DDP_ERR_INVALID_ARGUMENT, "comm");
  std::system(("rm -rf " + dir).c_str());
}

// Two processes (threads here) join a job of two at once, without a loss: the job grows to four, in
// one admission or two, and every rank reduces the same values as the others from then on.
TEST_CASE("elastic joins: two joiners grow a job of two to four") {
  if (!have_gloo()) return;
  const JoinScene scene;
  const std::string& method = scene.method;
  ddp_config_t cfg = scene.cfg;
  cfg.layout = DDP_LAYOUT_ARENA;
  const size_t n = 5000;
  std::mutex mu;
  std::vector<std::string> errors;
  std::vector<std::vector<float>> finals(4);
  // `who` is the thread's identity: 0 and 1 start the job, 2 and 3 join it. Each grad holds who + 1.
  auto run = [&](int who) {
    auto complain = [&](const char* what) {
      std::lock_guard<std::mutex> lock(mu);
      errors.push_back(std::to_string(who) + ": " + what + ": " + ddp_last_error());
    };
    ddp_comm_t c = nullptr;
    const ddp_status_t made = who < 2 ? ddp_comm_init_gloo_timeout(method.c_str(), who, 2, 20000, &c)
                                      : ddp_comm_join_gloo(method.c_str(), 20000, &c);
    ddp_t d = nullptr;
    int g = 0;
    if (made || ddp_create(c, &cfg, &d) || ddp_register_grad(d, nullptr, n, DDP_F32, 0, &g)) return complain("create");
    int world = 2;
    std::vector<float> state(3, 0.0f);  // stands for the model: every rank ends with the same
    auto change = [&] {
      ddp_membership_t m;
      if (ddp_recover(d, &m, nullptr, 0)) return false;
      void* buf = state.data();
      const size_t count = state.size();
      const ddp_dtype_t f32 = DDP_F32;
      world = m.world;
      return ddp_broadcast(d, &buf, &count, &f32, 1, m.source, nullptr) == DDP_SUCCESS;
    };
    if (who >= 2 && !change()) return complain("admission");
    int steps_at_four = 0;
    for (int it = 0; it < 3000 && steps_at_four < 4; ++it) {
      ddp_status_t st = ddp_begin_backward(d, nullptr);
      if (st == DDP_ERR_RANK_JOINING) {
        if (!change()) return complain("recover");
        continue;
      }
      float* p = nullptr;
      if (st || ddp_grad_ptr(d, g, reinterpret_cast<void**>(&p))) return complain("begin");
      std::fill(p, p + n, static_cast<float>(who + 1));
      if (ddp_grad_ready(d, g) || ddp_finish_backward(d, nullptr) || ddp_grad_ptr(d, g, reinterpret_cast<void**>(&p)))
        return complain("step");
      const float want = world == 4 ? 2.5f : world == 3 ? 2.0f : 1.5f;  // the mean of 1..world
      if (p[0] != want || p[n - 1] != want) return complain("the mean");
      for (float& x : state) x += p[0];
      if (world == 4) ++steps_at_four;
      if (world < 4) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::lock_guard<std::mutex> lock(mu);
    finals[static_cast<size_t>(who)] = state;
    if (world != 4) errors.push_back(std::to_string(who) + ": ended in a world of " + std::to_string(world));
    ddp_destroy(d);
    ddp_comm_destroy(c);
  };
  std::thread a(run, 0), b(run, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::thread j1(run, 2), j2(run, 3);
  a.join(), b.join(), j1.join(), j2.join();
  for (const std::string& e : errors) MESSAGE(e);
  CHECK(errors.empty());
  for (int r = 1; r < 4; ++r) CHECK(finals[static_cast<size_t>(r)] == finals[0]);
}

// A world larger than the open-file limit allows is refused before any connection is made, with the
// numbers and the fix, rather than failing half way through its meshes (host/limits.hpp).
TEST_CASE(
    "gloo: a world that needs more open files than the process may hold is refused at once, saying how to fix it") {
  if (!have_gloo()) return;
  char d[] = "/tmp/ddp_limits_XXXXXX";
  REQUIRE(mkdtemp(d));
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    struct rlimit r;
    r.rlim_cur = r.rlim_max = 128;
    if (::setrlimit(RLIMIT_NOFILE, &r) != 0) ::_exit(3);
    ddp_comm_t c = nullptr;
    const auto t0 = std::chrono::steady_clock::now();
    const ddp_status_t s = ddp_comm_init_gloo_timeout((std::string("file://") + d).c_str(), 3, 256, 20000, &c);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::string msg = ddp_last_error();
    const bool named = msg.find("a world of 256 ranks") != std::string::npos &&
                       msg.find("limit is 128 (hard limit 128)") != std::string::npos &&
                       msg.find("ulimit -n") != std::string::npos;
    if (s != DDP_ERR_UNSUPPORTED) ::_exit(4);
    ::_exit(!named ? 5 : secs > 2.0 ? 6 : 0);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  std::system((std::string("rm -rf ") + d).c_str());
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}
