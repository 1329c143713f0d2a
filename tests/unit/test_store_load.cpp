// The TCP store under load: a thousand clients, each with its own connection, each setting a key and
// reading all thousand (get_many: one request each, answered once every key is set), none lost; and a
// burst of a thousand connections at once (the backlog is SOMAXCONN, the loop accepts them all).
#include <doctest.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>

#include "host/store_wire.hpp"
#include "host/tcp.hpp"
#include "store_helpers.hpp"

using namespace store_test;

TEST_CASE("store: 1000 clients each set a key and get all 1000 in one request; all answered, none lost") {
  constexpr int kClients = 1000;
  ddp::StoreServer server(0);
  std::vector<std::string> keys;
  for (int i = 0; i < kClients; ++i) keys.push_back("load/" + std::to_string(i));
  std::atomic<int> whole{0}, failed{0};
  std::string first_error;
  std::mutex mu;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int i = 0; i < kClients; ++i)
    ts.emplace_back([&, i] {
      Thrown t = thrown([&] {
        const ddp::Deadline dl = ddp::Deadline::after_ms(60000);
        auto st = client(server.port());
        st->set(keys[i], bytes("value of " + std::to_string(i)), dl);
        const std::vector<std::vector<char>> all = st->get_many(keys, dl, "a client");
        bool ok = all.size() == keys.size();
        for (size_t k = 0; ok && k < all.size(); ++k) ok = text(all[k]) == "value of " + std::to_string(k);
        if (ok) ++whole;
      });
      if (t.status == DDP_SUCCESS) return;
      ++failed;
      std::lock_guard<std::mutex> lock(mu);
      if (first_error.empty()) first_error = t.message;
    });
  for (auto& t : ts) t.join();
  const double s = seconds_since(t0);
  const ddp::StoreCounters c = server.counters();
  MESSAGE(kClients << " clients, each a set and a get_many of " << kClients << " keys: " << s
                   << " s; the server: " << ddp::describe(c));
  INFO("first error: " << first_error);
  CHECK(failed == 0);
  CHECK(whole == kClients);
  CHECK(c.requests == 2 * kClients);
  CHECK(c.connections == kClients);
  CHECK(c.peak_connections <= kClients);
  CHECK(c.wakeups <= uint64_t(kClients) * kClients);
}

TEST_CASE("store: a burst of 1000 connections at once is accepted, and each is answered") {
  constexpr int kConns = 1000, kThreads = 8;
  ddp::StoreServer server(0);
  std::vector<ddp::tcp::Socket> socks(kConns);
  std::atomic<int> go{0};
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t)
    ts.emplace_back([&, t] {
      ++go;
      while (go < kThreads) std::this_thread::yield();
      for (int i = t; i < kConns; i += kThreads)
        socks[i] = ddp::tcp::try_connect("127.0.0.1", server.port(), ddp::Deadline::after_ms(10000));
    });
  for (auto& t : ts) t.join();
  const double connect_s = seconds_since(t0);
  int connected = 0;
  for (auto& s : socks) connected += s.valid();
  REQUIRE(connected == kConns);
  // A Try on every connection, then every answer: the loop serves them all.
  for (int i = 0; i < kConns; ++i) {
    ddp::store_wire::Writer w;
    const std::string f = w.u8(ddp::store_wire::kTry).u32(static_cast<uint32_t>(i + 1)).str("nothing").frame();
    ddp::tcp::send_all(socks[i], f.data(), f.size(), ddp::Deadline::after_ms(5000), "burst");
  }
  int answered = 0;
  for (int i = 0; i < kConns; ++i) {
    char a[9] = {};  // length 5, the id, found = 0
    ddp::tcp::recv_all(socks[i], a, sizeof a, ddp::Deadline::after_ms(10000), "burst");
    uint32_t len = 0, id = 0;
    std::memcpy(&len, a, 4);
    std::memcpy(&id, a + 4, 4);
    answered += len == 5 && id == static_cast<uint32_t>(i + 1) && a[8] == 0;
  }
  MESSAGE(kConns << " connections in a burst from " << kThreads << " threads: connected in " << connect_s
                 << " s; the server: " << ddp::describe(server.counters()));
  CHECK(answered == kConns);
  CHECK(connect_s < 5);  // a connection dropped from a full backlog waits a second or more to try again
  CHECK(server.counters().connections == kConns);
}
