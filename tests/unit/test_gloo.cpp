// The Gloo communicator inside one process: every bad init method and argument with its status and
// message, a rendezvous that a rank never joins (bounded, naming the rank), and ranks as threads that
// meet over tcp:// and file:// and reduce exactly. Multi-process runs are in tests/gloo.
#include <doctest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <string>
#include <thread>
#include <vector>

#include "ddp.h"

namespace {

bool have_gloo() {
  ddp_comm_t c = nullptr;
  const ddp_status_t s = ddp_comm_init_gloo("bogus://", 0, 1, &c);
  return s != DDP_ERR_UNSUPPORTED;
}

// A port nobody listens on now (the kernel's choice, released at once).
int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

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

}  // namespace

TEST_CASE("gloo: bad init methods and arguments are refused, saying why") {
  ddp_comm_t c = nullptr;
  if (!have_gloo()) {
    expect(ddp_comm_init_gloo("env://", 0, 1, &c), DDP_ERR_UNSUPPORTED, "without Gloo");
    return;
  }
  expect(ddp_comm_init_gloo("bogus://x", 0, 1, &c), DDP_ERR_INVALID_ARGUMENT, "unknown init method 'bogus://x'");
  expect(ddp_comm_init_gloo("tcp://nohost", 0, 1, &c), DDP_ERR_INVALID_ARGUMENT, "expected tcp://HOST:PORT");
  expect(ddp_comm_init_gloo("tcp://127.0.0.1:port", 0, 1, &c), DDP_ERR_INVALID_ARGUMENT, "not a non-negative integer");
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
    expect(ddp_comm_init_gloo(nullptr, -1, 1, &c), DDP_ERR_INVALID_ARGUMENT, "RANK is not set");
    expect(ddp_comm_init_gloo(nullptr, 0, -1, &c), DDP_ERR_INVALID_ARGUMENT, "WORLD_SIZE is not set");
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
