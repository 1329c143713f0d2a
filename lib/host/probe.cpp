#include "host/probe.hpp"

#include <unistd.h>

#include <atomic>
#include <thread>
#include <vector>

#include "host/tcp.hpp"

namespace ddp {

namespace {

struct Answer {
  uint64_t seq;
  Position pos;
};

struct Peer {
  std::string host;
  int port = 0;
};

class SocketProber final : public Prober {
 public:
  SocketProber(int rank, tcp::Socket listener, std::vector<Peer> peers, std::function<Position()> mine)
      : rank_(rank), listener_(std::move(listener)), peers_(std::move(peers)), mine_(std::move(mine)) {
    if (peers_.size() > 1) responder_ = std::thread([this] { serve(); });
  }
  ~SocketProber() override {
    stop_ = true;
    if (responder_.joinable()) responder_.join();
  }

  // One thread per rank asked (asks are rare: a stall warning, a timeout), all bounded by wait_ms.
  std::vector<Position> ask(int64_t wait_ms) override {
    std::vector<Position> out(peers_.size());
    out[static_cast<size_t>(rank_)] = mine_();
    const uint64_t seq = ++seq_;
    const Deadline dl = Deadline::after_ms(std::max<int64_t>(1, wait_ms));
    std::vector<std::thread> askers;
    for (size_t r = 0; r < peers_.size(); ++r) {
      if (static_cast<int>(r) == rank_) continue;
      askers.emplace_back([&, r] { out[r] = ask_rank(peers_[r].host, peers_[r].port, seq, dl); });
    }
    for (std::thread& t : askers) t.join();
    return out;
  }

 private:
  void serve() {
    name_this_thread("ddp-inspector");
    while (!stop_) {
      tcp::Socket c = tcp::accept_within(listener_, 20);
      if (!c.valid()) continue;
      try {
        Answer a{};
        tcp::recv_all(c, &a.seq, sizeof a.seq, Deadline::after_ms(1000), "answer");
        a.pos = mine_();
        tcp::send_all(c, &a, sizeof a, Deadline::after_ms(1000), "answer");
      } catch (const Error&) {
      }
    }
  }

  int rank_;
  tcp::Socket listener_;
  std::vector<Peer> peers_;
  std::function<Position()> mine_;
  std::atomic<uint64_t> seq_{0};
  std::atomic<bool> stop_{false};
  std::thread responder_;
};

std::string host_name() {
  char h[256] = "";
  if (::gethostname(h, sizeof h - 1) != 0) return "localhost";
  return h;
}

}  // namespace

Position ask_rank(const std::string& host, int port, uint64_t seq, Deadline dl) {
  Position none;
  try {
    bool refused = false;
    tcp::Socket s = tcp::try_connect(host, port, dl, &refused);
    if (refused) none.iteration = -2;  // nothing listens there: the process is gone
    if (!s.valid()) return none;
    none.iteration = kAcceptedSilent;  // from here on its kernel answered for it: the process lives
    tcp::send_all(s, &seq, sizeof seq, dl, "ask");
    Answer a{};
    tcp::recv_all(s, &a, sizeof a, dl, "ask");
    return a.seq == seq ? a.pos : none;
  } catch (const Error&) {
    return none;
  }
}

std::unique_ptr<Prober> make_socket_prober(Store& store, const std::string& key, int rank, int size,
                                           const std::string& host, std::function<Position()> mine, Deadline dl,
                                           const std::function<void()>& barrier) {
  tcp::Socket listener = tcp::listen_on(0, "the stall inspector's port");
  const std::string me = (host.empty() ? host_name() : host) + " " + std::to_string(tcp::bound_port(listener));
  store.set(key + "/" + std::to_string(rank), std::vector<char>(me.begin(), me.end()), dl);
  std::vector<Peer> peers(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    const std::vector<char> v = store.get(key + "/" + std::to_string(r), dl, "rank " + std::to_string(r));
    const std::string s(v.begin(), v.end());
    const size_t sp = s.rfind(' ');
    peers[static_cast<size_t>(r)] = Peer{s.substr(0, sp), std::atoi(s.c_str() + sp + 1)};
  }
  barrier();
  store.erase(key + "/" + std::to_string(rank));
  return std::unique_ptr<Prober>(new SocketProber(rank, std::move(listener), std::move(peers), std::move(mine)));
}

}  // namespace ddp
