// The TCP store: the server (rank 0's, or tools/ddp_store's) and the client every rank holds.
#include "host/store_tcp.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <thread>

#include "host/tcp.hpp"

namespace ddp {

namespace {

constexpr char kSet = 'S', kGet = 'G', kClaim = 'C', kTry = 'T';
// A request: op, u32 key length, key, and for a set or a claim u64 value length and the value. A set
// is answered with one byte, a get (once the key exists) with u64 length and the value, a claim with
// one byte (1: claimed; 0: followed by the value held), a try with one byte (1: followed by the value).

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
    for (Client& c : clients_) c.thread.join();
  }
  int port() const { return tcp::bound_port(listener_); }
  StoreCounters counters() const {
    StoreCounters c;
    c.requests = requests_, c.bytes_in = bytes_in_, c.bytes_out = bytes_out_;
    c.connections = accepted_, c.peak_connections = peak_, c.open_connections = open_;
    return c;
  }

 private:
  // Also joins the threads of connections that ended (ranks that left, clients that reconnected), so
  // that a long job does not keep one thread per connection it ever had.
  void accept_loop() {
    while (!stopped()) {
      tcp::Socket c = tcp::accept_within(listener_, 50);
      if (c.valid()) {
        ++accepted_;
        peak_ = std::max<uint64_t>(peak_, ++open_);
        auto done = std::make_shared<std::atomic<bool>>(false);
        clients_.push_back(Client{std::thread([this, done, s = std::make_shared<tcp::Socket>(std::move(c))] {
                                    serve(*s);
                                    done->store(true);
                                  }),
                                  done});
      }
      for (auto it = clients_.begin(); it != clients_.end();) {
        if (!it->done->load()) {
          ++it;
          continue;
        }
        it->thread.join();
        it = clients_.erase(it);
        --open_;
      }
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
        ++requests_;
        rx(s, &op, 1, Deadline::after_ms(60000), "store");
        if (!answer(s, op, read_blob<uint32_t>(s))) return;
      }
    } catch (const Error&) {
    }
  }
  // One request: false when the connection is to end.
  bool answer(const tcp::Socket& s, char op, const std::string& key) {
    if (op == kSet || op == kClaim) {
      const std::string v = read_blob<uint64_t>(s);
      std::vector<char> held;
      char won = 1;
      {
        std::lock_guard<std::mutex> lock(t_.mu);
        auto it = t_.kv.find(key);
        if (op == kClaim && it != t_.kv.end())
          held = it->second, won = 0;
        else
          t_.kv[key].assign(v.begin(), v.end());
      }
      t_.cv.notify_all();
      tx(s, &won, 1, Deadline::after_ms(60000), "store");
      if (!won) send_value(s, held);
      return true;
    }
    std::vector<char> v;
    if (op == kGet) {
      if (!wait_key(s, key, &v)) return false;
    } else if (op == kTry) {
      char found = 0;
      {
        std::lock_guard<std::mutex> lock(t_.mu);
        auto it = t_.kv.find(key);
        if (it != t_.kv.end()) v = it->second, found = 1;
      }
      tx(s, &found, 1, Deadline::after_ms(60000), "store");
      if (!found) return true;
    } else {
      return false;
    }
    send_value(s, v);
    return true;
  }
  void send_value(const tcp::Socket& s, const std::vector<char>& v) {
    const uint64_t n = v.size();
    tx(s, &n, sizeof n, Deadline::after_ms(60000), "store");
    tx(s, v.data(), v.size(), Deadline::after_ms(60000), "store");
  }
  template <class Len>
  std::string read_blob(const tcp::Socket& s) {
    Len n = 0;
    rx(s, &n, sizeof n, Deadline::after_ms(60000), "store");
    if (n > (Len(1) << 30)) fail(DDP_ERR_INVALID_ARGUMENT, "store: request too large");
    std::string v(static_cast<size_t>(n), '\0');
    rx(s, &v[0], v.size(), Deadline::after_ms(60000), "store");
    return v;
  }
  // False when the server stops or the client goes away while it waits (it gave up: its deadline
  // passed, or it died), so that no thread waits for a key nobody will read.
  bool wait_key(const tcp::Socket& s, const std::string& key, std::vector<char>* out) {
    std::unique_lock<std::mutex> lock(t_.mu);
    while (!t_.cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return t_.stop || t_.kv.count(key); })) {
      lock.unlock();
      const bool gone = tcp::hung_up(s);
      lock.lock();
      if (gone) return false;
    }
    if (!t_.kv.count(key)) return false;  // stopped (a key set just before the stop is still answered)
    *out = t_.kv[key];
    return true;
  }

  void rx(const tcp::Socket& s, void* p, size_t n, Deadline dl, const char* what) {
    tcp::recv_all(s, p, n, dl, what);
    bytes_in_ += n;
  }
  void tx(const tcp::Socket& s, const void* p, size_t n, Deadline dl, const char* what) {
    tcp::send_all(s, p, n, dl, what);
    bytes_out_ += n;
  }

  std::atomic<uint64_t> requests_{0}, bytes_in_{0}, bytes_out_{0}, accepted_{0}, peak_{0}, open_{0};
  tcp::Socket listener_;
  Table t_;
  std::thread acceptor_;
  struct Client {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::list<Client> clients_;  // touched by the acceptor only, joined after it
};

std::atomic<uint64_t> g_requests_sent{0};

class TcpStore final : public Store {
 public:
  TcpStore(std::unique_ptr<TcpStoreServer> server, tcp::Socket s, std::string host, int port)
      : server_(std::move(server)),
        s_(std::move(s)),
        host_(std::move(host)),
        port_(port),
        where_(host_ + ":" + std::to_string(port)) {}
  ~TcpStore() override {
    s_.close();
    server_.reset();
  }
  void set(const std::string& key, const std::vector<char>& value, Deadline dl) override {
    std::lock_guard<std::mutex> lock(mu_);
    usable(dl);
    guarded([&] {
      send_head(kSet, key, dl);
      send_value(key, value, dl);
      char ack = 0;
      tcp::recv_all(s_, &ack, 1, dl, what(key));
    });
  }
  bool claim(const std::string& key, const std::vector<char>& value, std::vector<char>* held, Deadline dl) override {
    std::lock_guard<std::mutex> lock(mu_);
    usable(dl);
    char won = 0;
    guarded([&] {
      send_head(kClaim, key, dl);
      send_value(key, value, dl);
      tcp::recv_all(s_, &won, 1, dl, what(key));
      if (!won) *held = recv_value(key, dl);
    });
    return won == 1;
  }
  bool try_get(const std::string& key, std::vector<char>* out, Deadline dl) override {
    std::lock_guard<std::mutex> lock(mu_);
    usable(dl);
    char found = 0;
    guarded([&] {
      send_head(kTry, key, dl);
      tcp::recv_all(s_, &found, 1, dl, what(key));
      if (found) *out = recv_value(key, dl);
    });
    return found == 1;
  }
  std::vector<char> get(const std::string& key, Deadline dl, const std::string& who) override {
    std::lock_guard<std::mutex> lock(mu_);
    usable(dl);
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
  // A request cut short left the connection out of step: a new one replaces it (the server ends the
  // old one's thread), or the store is out of reach. A store that answered before is there at once
  // or gone (its process died): a second is enough to tell, so that nothing that touches a dead
  // store (a join watch, ddp_destroy waiting for it, ddp_recover) waits the longer bounds.
  void usable(Deadline dl) {
    if (!broken_) return;
    try {
      s_ = tcp::connect_to(host_, port_, Deadline::earlier(dl, Deadline::after_ms(1000)),
                           "the rendezvous store at " + where_ + " (connecting again)");
      broken_ = false;
    } catch (const Error& e) {
      fail(DDP_ERR_ABORTED, "the rendezvous store at %s failed earlier, and cannot be reached again: %s",
           where_.c_str(), e.what());
    }
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
  void send_value(const std::string& key, const std::vector<char>& value, Deadline dl) {
    const uint64_t n = value.size();
    tcp::send_all(s_, &n, sizeof n, dl, what(key));
    tcp::send_all(s_, value.data(), value.size(), dl, what(key));
  }
  std::vector<char> recv_value(const std::string& key, Deadline dl) {
    uint64_t n = 0;
    tcp::recv_all(s_, &n, sizeof n, dl, what(key));
    std::vector<char> v(static_cast<size_t>(n));
    tcp::recv_all(s_, v.data(), v.size(), dl, what(key));
    return v;
  }
  void send_head(char op, const std::string& key, Deadline dl) {
    ++g_requests_sent;
    const uint32_t n = static_cast<uint32_t>(key.size());
    tcp::send_all(s_, &op, 1, dl, what(key));
    tcp::send_all(s_, &n, sizeof n, dl, what(key));
    tcp::send_all(s_, key.data(), key.size(), dl, what(key));
  }

  std::unique_ptr<TcpStoreServer> server_;  // rank 0 only
  tcp::Socket s_;
  std::string host_;
  int port_;
  std::string where_;
  std::mutex mu_;
  bool broken_ = false;
};
}  // namespace

std::shared_ptr<Store> open_tcp_store(const std::string& host, int port, bool serve, const std::string& who,
                                      Deadline dl, std::string* local) {
  std::unique_ptr<TcpStoreServer> server;
  if (serve) server.reset(new TcpStoreServer(port));
  const std::string where = host + ":" + std::to_string(port);
  tcp::Socket s = tcp::connect_to(host, port, dl, who + ": the rendezvous store at " + where);
  *local = tcp::local_address(s);
  return std::make_shared<TcpStore>(std::move(server), std::move(s), host, port);
}

struct StoreServer::Impl {
  explicit Impl(int port) : server(port) {}
  TcpStoreServer server;
};
StoreServer::StoreServer(int port) : impl_(new Impl(port)) {}
StoreServer::~StoreServer() = default;
int StoreServer::port() const { return impl_->server.port(); }
StoreCounters StoreServer::counters() const { return impl_->server.counters(); }

uint64_t tcp_store_requests_sent() { return g_requests_sent.load(); }

std::string describe(const StoreCounters& c) {
  return format("%llu requests, %llu bytes in, %llu bytes out, %llu connections (peak %llu open), %llu wake-ups",
                (unsigned long long)c.requests, (unsigned long long)c.bytes_in, (unsigned long long)c.bytes_out,
                (unsigned long long)c.connections, (unsigned long long)c.peak_connections,
                (unsigned long long)c.wakeups);
}

}  // namespace ddp
