#include "host/store.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <list>
#include <map>
#include <mutex>
#include <thread>

#include "host/tcp.hpp"
#include "core/knobs.hpp"

namespace ddp {

namespace {

constexpr char kSet = 'S', kGet = 'G';
// A request: op, u32 key length, key, and for a set u64 value length and the value. A set is answered
// with one byte, a get (once the key exists) with u64 length and the value.

struct Table {
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, std::vector<char>> kv;
  bool stop = false;
};

// Rank 0's server: one thread accepts, one thread per connection answers its requests in order.
class TcpStoreServer {
 public:
  explicit TcpStoreServer(int port) : listener_(tcp::listen_on(port, "the rendezvous store (rank 0)")) {
    acceptor_ = std::thread([this] { accept_loop(); });
  }
  ~TcpStoreServer() {
    {
      std::lock_guard<std::mutex> lock(t_.mu);
      t_.stop = true;
    }
    t_.cv.notify_all();
    acceptor_.join();
    for (std::thread& t : clients_) t.join();
  }
  int port() const { return tcp::bound_port(listener_); }

 private:
  void accept_loop() {
    while (!stopped()) {
      tcp::Socket c = tcp::accept_within(listener_, 50);
      if (c.valid()) clients_.emplace_back([this, s = std::make_shared<tcp::Socket>(std::move(c))] { serve(*s); });
    }
  }
  bool stopped() {
    std::lock_guard<std::mutex> lock(t_.mu);
    return t_.stop;
  }
  // Requests are read with short deadlines so that the thread notices the stop; a client that
  // disconnects or sends garbage ends its thread.
  void serve(const tcp::Socket& s) {
    try {
      for (;;) {
        while (!tcp::readable_within(s, 100))
          if (stopped()) return;
        char op = 0;
        tcp::recv_all(s, &op, 1, Deadline::after_ms(60000), "store");
        std::string key = read_blob<uint32_t>(s);
        if (op == kSet) {
          std::string v = read_blob<uint64_t>(s);
          {
            std::lock_guard<std::mutex> lock(t_.mu);
            t_.kv[key].assign(v.begin(), v.end());
          }
          t_.cv.notify_all();
          const char ack = 1;
          tcp::send_all(s, &ack, 1, Deadline::after_ms(60000), "store");
        } else if (op == kGet) {
          std::vector<char> v;
          if (!wait_key(key, &v)) return;
          const uint64_t n = v.size();
          tcp::send_all(s, &n, sizeof n, Deadline::after_ms(60000), "store");
          tcp::send_all(s, v.data(), v.size(), Deadline::after_ms(60000), "store");
        } else {
          return;
        }
      }
    } catch (const Error&) {
    }
  }
  template <class Len>
  std::string read_blob(const tcp::Socket& s) {
    Len n = 0;
    tcp::recv_all(s, &n, sizeof n, Deadline::after_ms(60000), "store");
    if (n > (Len(1) << 30)) fail(DDP_ERR_INVALID_ARGUMENT, "store: request too large");
    std::string v(static_cast<size_t>(n), '\0');
    tcp::recv_all(s, &v[0], v.size(), Deadline::after_ms(60000), "store");
    return v;
  }
  bool wait_key(const std::string& key, std::vector<char>* out) {
    std::unique_lock<std::mutex> lock(t_.mu);
    t_.cv.wait(lock, [&] { return t_.stop || t_.kv.count(key); });
    if (t_.stop) return false;
    *out = t_.kv[key];
    return true;
  }

  tcp::Socket listener_;
  Table t_;
  std::thread acceptor_;
  std::list<std::thread> clients_;  // touched by the acceptor only, joined after it
};

class TcpStore final : public Store {
 public:
  TcpStore(std::unique_ptr<TcpStoreServer> server, tcp::Socket s, std::string where)
      : server_(std::move(server)), s_(std::move(s)), where_(std::move(where)) {}
  ~TcpStore() override {
    s_.close();
    server_.reset();
  }
  void set(const std::string& key, const std::vector<char>& value, Deadline dl) override {
    std::lock_guard<std::mutex> lock(mu_);
    usable();
    guarded([&] {
      send_head(kSet, key, dl);
      const uint64_t n = value.size();
      tcp::send_all(s_, &n, sizeof n, dl, what(key));
      tcp::send_all(s_, value.data(), value.size(), dl, what(key));
      char ack = 0;
      tcp::recv_all(s_, &ack, 1, dl, what(key));
    });
  }
  std::vector<char> get(const std::string& key, Deadline dl, const std::string& who) override {
    std::lock_guard<std::mutex> lock(mu_);
    usable();
    std::vector<char> v;
    guarded([&] {
      send_head(kGet, key, dl);
      uint64_t n = 0;
      try {
        tcp::recv_all(s_, &n, sizeof n, dl, what(key));
      } catch (const Error& e) {
        if (!dl.passed()) throw;
        fail(DDP_ERR_TIMEOUT, "the rendezvous at %s did not complete before the timeout: %s never arrived (key '%s')",
             where_.c_str(), who.c_str(), key.c_str());
      }
      v.resize(static_cast<size_t>(n));
      tcp::recv_all(s_, v.data(), v.size(), dl, what(key));
    });
    return v;
  }

 private:
  std::string what(const std::string& key) const {
    return "the rendezvous store at " + where_ + " (key '" + key + "')";
  }
  void usable() const {
    if (broken_) fail(DDP_ERR_ABORTED, "the rendezvous store at %s failed earlier", where_.c_str());
  }
  // A request cut short leaves the connection out of step: it is not used again.
  template <class F>
  void guarded(F&& f) {
    try {
      f();
    } catch (...) {
      broken_ = true;
      throw;
    }
  }
  void send_head(char op, const std::string& key, Deadline dl) {
    const uint32_t n = static_cast<uint32_t>(key.size());
    tcp::send_all(s_, &op, 1, dl, what(key));
    tcp::send_all(s_, &n, sizeof n, dl, what(key));
    tcp::send_all(s_, key.data(), key.size(), dl, what(key));
  }

  std::unique_ptr<TcpStoreServer> server_;  // rank 0 only
  tcp::Socket s_;
  std::string where_;
  std::mutex mu_;
  bool broken_ = false;
};

// Keys are files of one directory, written under a temporary name and renamed, so a reader never
// sees half a value.
class FileStore final : public Store {
 public:
  explicit FileStore(std::string dir) : dir_(std::move(dir)) {}
  void set(const std::string& key, const std::vector<char>& value, Deadline) override {
    const std::string path = file(key), tmp = path + ".tmp" + std::to_string(::getpid());
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      f.write(value.data(), static_cast<std::streamsize>(value.size()));
      if (!f) fail(DDP_ERR_INVALID_ARGUMENT, "the rendezvous directory %s: cannot write %s", dir_.c_str(), tmp.c_str());
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0)
      fail(DDP_ERR_INVALID_ARGUMENT, "the rendezvous directory %s: cannot rename %s", dir_.c_str(), tmp.c_str());
  }
  std::vector<char> get(const std::string& key, Deadline dl, const std::string& who) override {
    const std::string path = file(key);
    for (;;) {
      std::ifstream f(path, std::ios::binary);
      if (f) return std::vector<char>(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
      if (dl.passed())
        fail(DDP_ERR_TIMEOUT, "the rendezvous in %s did not complete before the timeout: %s never arrived (no file %s)",
             dir_.c_str(), who.c_str(), path.c_str());
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  void erase(const std::string& key) override { std::remove(file(key).c_str()); }

 private:
  std::string file(const std::string& key) const {
    std::string k = key;
    for (char& c : k)
      if (c == '/') c = '.';
    return dir_ + "/" + k;
  }
  std::string dir_;
};

int parse_int(const char* text, const char* what, const char* hint) {
  if (!text || !*text) fail(DDP_ERR_INVALID_ARGUMENT, "%s is not set%s", what, hint);
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  if (*end || v < 0 || v > 1 << 30) fail(DDP_ERR_INVALID_ARGUMENT, "%s='%s' is not a non-negative integer", what, text);
  return static_cast<int>(v);
}

constexpr const char* kEnvHint =
    " (env:// reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE, as torchrun sets them; or pass "
    "tcp://HOST:PORT or file:///DIR with the rank and size)";

std::shared_ptr<Store> open_tcp(const std::string& host, int port, int rank, Deadline dl, std::string* local) {
  std::unique_ptr<TcpStoreServer> server;
  if (rank == 0) server.reset(new TcpStoreServer(port));
  const std::string where = host + ":" + std::to_string(port);
  tcp::Socket s =
      tcp::connect_to(host, port, dl, "rank " + std::to_string(rank) + ": the rendezvous store at " + where);
  *local = tcp::local_address(s);
  return std::make_shared<TcpStore>(std::move(server), std::move(s), where);
}

void split_host_port(const std::string& hp, std::string* host, int* port) {
  const size_t colon = hp.rfind(':');
  if (colon == std::string::npos || colon == 0)
    fail(DDP_ERR_INVALID_ARGUMENT, "init method 'tcp://%s': expected tcp://HOST:PORT", hp.c_str());
  *host = hp.substr(0, colon);
  if (host->size() > 2 && host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  *port = parse_int(hp.c_str() + colon + 1, "the port of tcp://HOST:PORT", "");
}

}  // namespace

int env_store_port(int master_port) { return knobs::store_port(master_port); }

Rendezvous open_rendezvous(const char* init_method, int rank, int size, Deadline dl) {
  std::string m = init_method && *init_method ? init_method : "env://";
  Rendezvous rv;
  rv.rank = rank >= 0 ? rank : parse_int(std::getenv("RANK"), "RANK", kEnvHint);
  rv.size = size >= 0 ? size : parse_int(std::getenv("WORLD_SIZE"), "WORLD_SIZE", kEnvHint);
  if (rv.size < 1 || rv.rank >= rv.size)
    fail(DDP_ERR_INVALID_ARGUMENT, "rank %d of a world of %d: the rank must lie in 0..size-1", rv.rank, rv.size);
  if (m == "env://") {
    const char* addr = std::getenv("MASTER_ADDR");
    if (!addr || !*addr) fail(DDP_ERR_INVALID_ARGUMENT, "MASTER_ADDR is not set%s", kEnvHint);
    const int port = env_store_port(parse_int(std::getenv("MASTER_PORT"), "MASTER_PORT", kEnvHint));
    rv.store = open_tcp(addr, port, rv.rank, dl, &rv.host);
    rv.describe = "env:// (" + std::string(addr) + ":" + std::to_string(port) + ")";
  } else if (m.compare(0, 6, "tcp://") == 0) {
    std::string host;
    int port = 0;
    split_host_port(m.substr(6), &host, &port);
    rv.store = open_tcp(host, port, rv.rank, dl, &rv.host);
    rv.describe = m;
  } else if (m.compare(0, 7, "file://") == 0 && m.size() > 7) {
    const std::string dir = m.substr(7);
    struct stat st;
    if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      fail(DDP_ERR_INVALID_ARGUMENT,
           "init method '%s': %s is not a directory (make it first, empty, on a file system "
           "every rank sees)",
           m.c_str(), dir.c_str());
    rv.store = std::make_shared<FileStore>(dir);
    rv.describe = m;
  } else {
    fail(DDP_ERR_INVALID_ARGUMENT, "unknown init method '%s': expected env://, tcp://HOST:PORT or file:///DIR",
         m.c_str());
  }
  return rv;
}

}  // namespace ddp
