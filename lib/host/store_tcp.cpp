// The TCP store's client: one connection per store and process, shared by every thread that uses the
// store. Requests carry ids and go out whole, so that many can be under way at once on the one
// connection (a watch that blocks for minutes does not hold up the others); answers come back in any
// order and find their caller by id. No thread is started to read them: a caller that waits reads for
// everyone while it waits, and hands the reading over when its own answer came.
#include "host/store_tcp.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <errno.h>

#include <climits>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>

#include "host/store_wire.hpp"
#include "host/tcp.hpp"

namespace ddp {

namespace {

namespace w = store_wire;

std::atomic<uint64_t> g_requests_sent{0};

// How long past its deadline a Get waits for the server's own answer at that deadline, which names
// the key still missing; a server that has not answered by then is not waited for.
constexpr int64_t kLateAnswerMs = 250;

// One connection to the server. Broken for good at its first failure (the server gone, a request cut
// short); the store then makes a new one.
class Link {
 public:
  struct Call {
    bool done = false;
    std::string answer;  // the answer's fields, after the id
  };
  enum class End { Answered, Deadline, Stopped };

  explicit Link(tcp::Socket s) : s_(std::move(s)), wake_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}
  ~Link() {
    if (wake_ >= 0) ::close(wake_);
  }
  bool broken() {
    std::lock_guard<std::mutex> lock(mu_);
    return broken_;
  }
  // Files `c` to receive the answer to the request with the id returned.
  uint32_t start(Call* c) {
    std::lock_guard<std::mutex> lock(mu_);
    if (++next_id_ == 0) ++next_id_;
    calls_[next_id_] = c;
    return next_id_;
  }
  void forget(uint32_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    calls_.erase(id);
  }
  // Sends one whole frame; a frame cut short (the deadline, a broken connection) breaks the link.
  void send(const std::string& frame, Deadline dl, const std::string& what) {
    std::lock_guard<std::mutex> lock(send_mu_);
    try {
      tcp::send_all(s_, frame.data(), frame.size(), dl, what);
    } catch (const Error& e) {
      const std::string m = e.what(),
                        why = m.compare(0, what.size() + 2, what + ": ") == 0 ? m.substr(what.size() + 2) : m;
      break_link(why);
      throw;
    }
    ++g_requests_sent;
  }
  End wait(Call* c, uint32_t id, Deadline dl, const std::atomic<bool>* stop, const std::string& what);
  // Makes the waits under way look at their `stop`.
  void wake() {
    std::lock_guard<std::mutex> lock(mu_);
    cv_.notify_all();
    const uint64_t one = 1;
    if (::write(wake_, &one, sizeof one) < 0) {
    }
  }
  // Fails every call under way with `why`; the server, seeing the connection end, drops its waits.
  void break_link(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_) return;
    why_ = why;
    broken_ = true;
    ::shutdown(s_.fd(), SHUT_RDWR);  // also ends the reader's poll
    cv_.notify_all();
  }

 private:
  void read_for(Deadline dl);
  void dispatch();

  tcp::Socket s_;
  int wake_;
  std::mutex send_mu_;  // one frame at a time
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint32_t, Call*> calls_;
  uint32_t next_id_ = 0;
  bool reading_ = false;  // a caller reads the socket for everyone
  bool broken_ = false;
  std::string why_;   // why it broke: "the peer closed the connection (...)"
  std::string rbuf_;  // input not handed out yet (the reader's alone)
};

// A request sent at its deadline still has a millisecond for its answer, as a read has.
Link::End Link::wait(Call* c, uint32_t id, Deadline dl, const std::atomic<bool>* stop, const std::string& what) {
  dl = Deadline::later(dl, Deadline::after_ms(1));
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (c->done) return End::Answered;
    End end = End::Answered;
    if (broken_) {
      calls_.erase(id);
      fail(DDP_ERR_TIMEOUT, "%s: %s", what.c_str(), why_.c_str());
    }
    if (stop && stop->load()) end = End::Stopped;
    if (dl.passed()) end = End::Deadline;
    if (end != End::Answered) {
      calls_.erase(id);
      return end;
    }
    if (!reading_) {
      reading_ = true;
      lock.unlock();
      read_for(dl);
      lock.lock();
      reading_ = false;
      cv_.notify_all();  // the next waiter reads, if this one is done
    } else if (dl.infinite()) {
      cv_.wait(lock);
    } else {
      cv_.wait_until(lock, dl.at());
    }
  }
}

// One turn of reading: until input came, the link was woken, or the deadline.
void Link::read_for(Deadline dl) {
  pollfd p[2] = {{s_.fd(), POLLIN, 0}, {wake_, POLLIN, 0}};
  const int ms = dl.infinite() ? -1 : static_cast<int>(tcp::ms_left(dl, INT_MAX));
  if (::poll(p, 2, ms) <= 0) return;
  if (p[1].revents) {
    uint64_t v = 0;
    if (::read(wake_, &v, sizeof v) < 0) {
    }
  }
  if (!p[0].revents) return;
  std::string why;
  char buf[65536];
  for (;;) {
    const ssize_t k = ::recv(s_.fd(), buf, sizeof buf, MSG_DONTWAIT);
    if (k > 0) {
      rbuf_.append(buf, static_cast<size_t>(k));
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k == 0) why = "the peer closed the connection (its process exited or was killed)";
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
      why = std::string("the connection broke: ") + std::strerror(errno);
    break;
  }
  dispatch();
  if (!why.empty()) break_link(why);
}

// Hands every whole answer in the input to its caller (an answer nobody waits for any more is dropped).
void Link::dispatch() {
  size_t at = 0;
  std::lock_guard<std::mutex> lock(mu_);
  while (rbuf_.size() - at >= 4) {
    uint32_t len = 0;
    std::memcpy(&len, rbuf_.data() + at, 4);
    if (len < 4 || len > w::kMaxFrame) {
      if (!broken_) why_ = "a malformed answer", broken_ = true, ::shutdown(s_.fd(), SHUT_RDWR);
      break;
    }
    if (rbuf_.size() - at - 4 < len) break;
    uint32_t id = 0;
    std::memcpy(&id, rbuf_.data() + at + 4, 4);
    auto it = calls_.find(id);
    if (it != calls_.end()) {
      it->second->answer.assign(rbuf_, at + 8, len - 4);
      it->second->done = true;
      calls_.erase(it);
    }
    at += 4 + size_t(len);
  }
  rbuf_.erase(0, at);
  cv_.notify_all();
}

class TcpStore final : public Store {
 public:
  TcpStore(std::unique_ptr<StoreServer> server, tcp::Socket s, std::string host, int port)
      : server_(std::move(server)),
        link_(std::make_shared<Link>(std::move(s))),
        host_(std::move(host)),
        port_(port),
        where_(host_ + ":" + std::to_string(port)) {}
  ~TcpStore() override {
    link_.reset();
    server_.reset();
  }
  void set(const std::string& key, const std::vector<char>& value, Deadline dl) override {
    ask(w::kSet, key, dl, [&](w::Writer& f) { f.str(key).blob(value); });
  }
  bool claim(const std::string& key, const std::vector<char>& value, std::vector<char>* held, Deadline dl) override {
    const std::string a = ask(w::kClaim, key, dl, [&](w::Writer& f) { f.str(key).blob(value); });
    w::Reader r(a.data(), a.size());
    if (r.u8() == 1) return true;
    *held = r.blob();
    return false;
  }
  bool try_get(const std::string& key, std::vector<char>* out, Deadline dl) override {
    const std::string a = ask(w::kTry, key, dl, [&](w::Writer& f) { f.str(key); });
    w::Reader r(a.data(), a.size());
    if (r.u8() != 1) return false;
    *out = r.blob();
    return true;
  }
  std::vector<char> get(const std::string& key, Deadline dl, const std::string& who) override {
    return std::move(get_keys({key}, true, dl, [&who](const std::string&) { return who; })[0]);
  }
  std::vector<std::vector<char>> get_many(const std::vector<std::string>& keys, Deadline dl, const Who& who) override {
    return get_keys(keys, true, dl, who);
  }
  void wait(const std::vector<std::string>& keys, Deadline dl, const Who& who) override {
    get_keys(keys, false, dl, who);
  }
  bool watch(const std::vector<std::string>& keys, std::vector<Seen>* seen, Deadline dl, const std::atomic<bool>* stop,
             int look_ms) override;
  void interrupt() override {
    std::shared_ptr<Link> l;
    {
      std::lock_guard<std::mutex> lock(mu_);
      l = link_;
    }
    l->wake();
  }

 private:
  std::string what(const std::string& key) const {
    return "the rendezvous store at " + where_ + " (key '" + key + "')";
  }
  std::shared_ptr<Link> link(Deadline dl);
  // Sends one request, its fields written by `fields`, and returns its answer. A request the server
  // answers at once that has no answer by `dl` breaks the link (the server is gone or stuck).
  template <class F>
  std::string ask(uint8_t op, const std::string& key, Deadline dl, F&& fields) {
    Link::Call c;
    std::shared_ptr<Link> l;
    uint32_t id = 0;
    const Link::End end = call(op, key, dl, nullptr, &c, &l, &id, fields);
    if (end != Link::End::Answered) {
      l->break_link("no answer before the timeout");
      fail(DDP_ERR_TIMEOUT, "%s: no answer before the timeout", what(key).c_str());
    }
    return std::move(c.answer);
  }
  // Sends one request and waits for its answer in *c (`used`: the link it went over; *id_out: its id).
  template <class F>
  Link::End call(uint8_t op, const std::string& key, Deadline dl, const std::atomic<bool>* stop, Link::Call* c,
                 std::shared_ptr<Link>* used, uint32_t* id_out, F&& fields) {
    std::shared_ptr<Link> l = link(dl);
    *used = l;
    const uint32_t id = *id_out = l->start(c);
    w::Writer f;
    f.u8(op).u32(id);
    fields(f);
    try {
      l->send(f.frame(), dl, what(key));
    } catch (...) {
      l->forget(id);
      throw;
    }
    return l->wait(c, id, dl, stop, what(key));
  }
  // Tells the server to drop a waiting request nobody waits for any more (best effort).
  void cancel(Link& l, uint32_t id) {
    try {
      w::Writer f;
      f.u8(w::kCancel).u32(0).u32(id);
      l.send(f.frame(), Deadline::after_ms(1000), "the rendezvous store at " + where_ + " (cancel)");
    } catch (const Error&) {
    }
  }
  std::vector<std::vector<char>> get_keys(const std::vector<std::string>& keys, bool values, Deadline dl,
                                          const Who& who);

  std::unique_ptr<StoreServer> server_;  // the process that serves the store only
  std::mutex mu_;                        // guards link_
  std::shared_ptr<Link> link_;
  std::string host_;
  int port_;
  std::string where_;
};

// A link that broke is replaced, or the store is out of reach. A store that answered before is there
// at once or gone (its process died): a second is enough to tell, so that nothing that touches a dead
// store (a join watch, ddp_destroy waiting for it, ddp_recover) waits the longer bounds.
std::shared_ptr<Link> TcpStore::link(Deadline dl) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!link_->broken()) return link_;
  try {
    link_ = std::make_shared<Link>(tcp::connect_to(host_, port_, Deadline::earlier(dl, Deadline::after_ms(1000)),
                                                   "the rendezvous store at " + where_ + " (connecting again)"));
  } catch (const Error& e) {
    fail(DDP_ERR_ABORTED, "the rendezvous store at %s failed earlier, and cannot be reached again: %s", where_.c_str(),
         e.what());
  }
  return link_;
}

// The wait's bound rides with the request: at the deadline the server answers with the key still
// missing, which the client waits for a little past its own deadline.
std::vector<std::vector<char>> TcpStore::get_keys(const std::vector<std::string>& keys, bool values, Deadline dl,
                                                  const Who& who) {
  std::vector<std::vector<char>> out(keys.size());
  if (keys.empty()) return out;
  const uint32_t wait_ms = dl.infinite() ? w::kForever : static_cast<uint32_t>(tcp::ms_left(dl, w::kForever - 1));
  const Deadline until = dl.infinite() ? dl : Deadline::after_ms(int64_t(wait_ms) + kLateAnswerMs);
  Link::Call c;
  std::shared_ptr<Link> l;
  uint32_t id = 0;
  const Link::End end = call(w::kGet, keys[0], until, nullptr, &c, &l, &id, [&](w::Writer& f) {
    f.u32(wait_ms).u8(values ? 1 : 0).u32(static_cast<uint32_t>(keys.size()));
    for (const std::string& k : keys) f.str(k);
  });
  size_t missing = 0;
  w::Reader r(c.answer.data(), c.answer.size());
  if (end == Link::End::Answered && r.u8() == 1) {
    for (size_t i = 0; values && i < keys.size(); ++i) out[i] = r.blob();
    if (r.ok()) return out;
    l->break_link("a malformed answer");
    fail(DDP_ERR_TIMEOUT, "%s: a malformed answer", what(keys[0]).c_str());
  }
  if (end == Link::End::Answered) missing = std::min<size_t>(r.u32(), keys.size() - 1);
  const std::string& key = keys[missing];
  fail(DDP_ERR_TIMEOUT, "the rendezvous at %s did not complete before the timeout: %s never arrived (key '%s')",
       where_.c_str(), who(key).c_str(), key.c_str());
}

bool TcpStore::watch(const std::vector<std::string>& keys, std::vector<Seen>* seen, Deadline dl,
                     const std::atomic<bool>* stop, int) {
  if (keys.empty()) return false;
  const uint32_t wait_ms = dl.infinite() ? w::kForever : static_cast<uint32_t>(tcp::ms_left(dl, w::kForever - 1));
  Link::Call c;
  std::shared_ptr<Link> l;
  uint32_t id = 0;
  const Link::End end = call(w::kWatch, keys[0], dl, stop, &c, &l, &id, [&](w::Writer& f) {
    f.u32(wait_ms).u32(static_cast<uint32_t>(keys.size()));
    for (size_t i = 0; i < keys.size(); ++i) {
      f.str(keys[i]).u8((*seen)[i].set ? 1 : 0);
      if ((*seen)[i].set) f.blob((*seen)[i].value);
    }
  });
  if (end == Link::End::Stopped) cancel(*l, id);  // (at the deadline the server ends it itself)
  w::Reader r(c.answer.data(), c.answer.size());
  if (end != Link::End::Answered || r.u8() != 1) return false;
  std::vector<Seen> now(keys.size());
  for (Seen& s : now) {
    s.set = r.u8() == 1;
    if (s.set) s.value = r.blob();
  }
  if (!r.ok()) fail(DDP_ERR_TIMEOUT, "%s: a malformed answer", what(keys[0]).c_str());
  *seen = std::move(now);
  return true;
}

}  // namespace

std::shared_ptr<Store> open_tcp_store(const std::string& host, int port, bool serve, const std::string& who,
                                      Deadline dl, std::string* local) {
  std::unique_ptr<StoreServer> server;
  if (serve) server.reset(new StoreServer(port));
  const std::string where = host + ":" + std::to_string(port);
  tcp::Socket s = tcp::connect_to(host, port, dl, who + ": the rendezvous store at " + where);
  *local = tcp::local_address(s);
  return std::make_shared<TcpStore>(std::move(server), std::move(s), host, port);
}

uint64_t tcp_store_requests_sent() { return g_requests_sent.load(); }

}  // namespace ddp
