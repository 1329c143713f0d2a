// The TCP store (host/store_tcp.hpp): its requests and answers, get_many in one request, waits that
// wake only for their key and send nothing while they wait, deadlines that name the key, a server gone
// mid-wait and then given up on within a second, a client that sends half a frame (the server's loop
// goes on), and many requests under way at once on one connection.
#include <doctest.h>

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "host/tcp.hpp"
#include "store_helpers.hpp"

using namespace store_test;

TEST_CASE("store: set, get, claim and try_get over TCP; get_many and wait of many keys in one request") {
  ddp::StoreServer server(0);
  auto st = client(server.port());
  const ddp::Deadline dl = ddp::Deadline::after_ms(5000);
  std::vector<char> v;
  CHECK(!st->try_get("a", &v, dl));
  st->set("a", bytes("one"), dl);
  CHECK(text(st->get("a", dl, "rank 0")) == "one");
  CHECK(st->try_get("a", &v, dl));
  CHECK(text(v) == "one");
  std::vector<char> held;
  CHECK(st->claim("b", bytes("first"), &held, dl));
  CHECK(!st->claim("b", bytes("second"), &held, dl));
  CHECK(text(held) == "first");
  st->set("empty", {}, dl);
  CHECK(st->get("empty", dl, "rank 0").empty());

  std::vector<std::string> keys;
  for (int i = 0; i < 100; ++i) {
    keys.push_back("k/" + std::to_string(i));
    st->set(keys.back(), bytes("value " + std::to_string(i)), dl);
  }
  const uint64_t sent = ddp::tcp_store_requests_sent(), served = server.counters().requests;
  const std::vector<std::vector<char>> all = st->get_many(keys, dl, "rank 1");
  CHECK(ddp::tcp_store_requests_sent() - sent == 1);
  CHECK(server.counters().requests - served == 1);
  REQUIRE(all.size() == keys.size());
  for (size_t i = 0; i < keys.size(); ++i) CHECK(text(all[i]) == "value " + std::to_string(i));
  st->wait(keys, dl, [](const std::string&) { return std::string("rank 1"); });
  CHECK(ddp::tcp_store_requests_sent() - sent == 2);
  const ddp::StoreCounters c = server.counters();
  CHECK(c.connections == 1);
  CHECK(c.bytes_in > 0);
  CHECK(c.bytes_out > 0);
}

TEST_CASE("store: a get waits for its key, and only a set of that key wakes it") {
  ddp::StoreServer server(0);
  auto setter = client(server.port());
  constexpr int kWaiters = 20;
  std::vector<std::shared_ptr<ddp::Store>> waiters;
  for (int i = 0; i < kWaiters; ++i) waiters.push_back(client(server.port()));
  std::vector<std::string> got(kWaiters);
  std::vector<std::thread> ts;
  const uint64_t before = server.counters().requests;  // (what opening the clients asked)
  for (int i = 0; i < kWaiters; ++i)
    ts.emplace_back([&, i] {
      got[i] = text(waiters[i]->get("w/" + std::to_string(i), ddp::Deadline::after_ms(20000), "a setter"));
    });
  while (server.counters().requests < before + kWaiters) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const ddp::Deadline dl = ddp::Deadline::after_ms(5000);
  for (int i = 0; i < 200; ++i) setter->set("other/" + std::to_string(i), bytes("x"), dl);  // nobody waits for these
  CHECK(server.counters().wakeups == 0);
  for (int i = 0; i < kWaiters; ++i) setter->set("w/" + std::to_string(i), bytes("for " + std::to_string(i)), dl);
  for (auto& t : ts) t.join();
  for (int i = 0; i < kWaiters; ++i) CHECK(got[i] == "for " + std::to_string(i));
  CHECK(server.counters().wakeups == kWaiters);  // one each
}

TEST_CASE("store: wait_change sends nothing while it waits, and answers when the key is set or changes") {
  ddp::StoreServer server(0);
  auto st = client(server.port());
  auto other = client(server.port());
  ddp::Store::Seen seen;
  std::atomic<bool> done{false};
  bool changed = false;
  std::thread t([&] {
    changed = st->wait_change("watched", &seen, ddp::Deadline::after_ms(20000));
    done = true;
  });
  while (server.counters().requests < 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const uint64_t sent = ddp::tcp_store_requests_sent(), served = server.counters().requests;
  std::this_thread::sleep_for(std::chrono::seconds(1));
  CHECK(ddp::tcp_store_requests_sent() - sent == 0);  // idle: no request in a second
  CHECK(server.counters().requests - served == 0);
  CHECK(!done);
  other->set("watched", bytes("v1"), ddp::Deadline::after_ms(5000));
  t.join();
  CHECK(changed);
  CHECK(seen.set);
  CHECK(text(seen.value) == "v1");
  // Known as "v1": the same value set again is no change; another value is.
  const auto t0 = std::chrono::steady_clock::now();
  std::thread u([&] { changed = st->wait_change("watched", &seen, ddp::Deadline::after_ms(20000)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  other->set("watched", bytes("v1"), ddp::Deadline::after_ms(5000));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  other->set("watched", bytes("v2"), ddp::Deadline::after_ms(5000));
  u.join();
  CHECK(changed);
  CHECK(text(seen.value) == "v2");
  CHECK(seconds_since(t0) >= 0.35);
  // Nothing changes: false at the deadline, `seen` as it was.
  const auto t1 = std::chrono::steady_clock::now();
  CHECK(!st->wait_change("watched", &seen, ddp::Deadline::after_ms(300)));
  CHECK(text(seen.value) == "v2");
  CHECK(seconds_since(t1) >= 0.29);
  CHECK(seconds_since(t1) < 2);
}

TEST_CASE("store: a watch of many keys answers when any one changes; interrupt ends a stopped watch at once") {
  ddp::StoreServer server(0);
  auto st = client(server.port());
  std::vector<std::string> keys{"m/0", "m/1", "m/2"};
  std::vector<ddp::Store::Seen> seen(keys.size());
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    client(server.port())->set("m/1", bytes("here"), ddp::Deadline::after_ms(5000));
  });
  CHECK(st->watch(keys, &seen, ddp::Deadline::after_ms(20000)));
  t.join();
  CHECK(!seen[0].set);
  CHECK(seen[1].set);
  CHECK(text(seen[1].value) == "here");
  CHECK(!seen[2].set);

  std::atomic<bool> stop{false};
  bool changed = true;
  std::thread w([&] { changed = st->watch(keys, &seen, ddp::Deadline::after_ms(60000), &stop); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto t0 = std::chrono::steady_clock::now();
  stop = true;
  st->interrupt();
  w.join();
  CHECK(!changed);
  CHECK(seconds_since(t0) < 0.5);
}

TEST_CASE("store: many requests under way at once on one connection, each answered to its caller") {
  ddp::StoreServer server(0);
  auto st = client(server.port());
  constexpr int kThreads = 16;
  std::vector<std::string> got(kThreads);
  std::vector<std::thread> ts;
  for (int i = 0; i < kThreads; ++i)  // each waits for the key the next one sets
    ts.emplace_back([&, i] {
      const ddp::Deadline dl = ddp::Deadline::after_ms(20000);
      got[i] = text(st->get("chain/" + std::to_string(i), dl, "the next thread"));
      if (i > 0) st->set("chain/" + std::to_string(i - 1), bytes("from " + std::to_string(i)), dl);
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  st->set("chain/" + std::to_string(kThreads - 1), bytes("from main"), ddp::Deadline::after_ms(5000));
  for (auto& t : ts) t.join();
  CHECK(got[kThreads - 1] == "from main");
  for (int i = 0; i + 1 < kThreads; ++i) CHECK(got[i] == "from " + std::to_string(i + 1));
  CHECK(server.counters().connections == 1);
}

TEST_CASE("store: a wait that times out names its key and who never set it") {
  ddp::StoreServer server(0);
  auto st = client(server.port());
  const auto t0 = std::chrono::steady_clock::now();
  Thrown t = thrown([&] { st->get("never", ddp::Deadline::after_ms(300), "rank 7"); });
  const double s = seconds_since(t0);
  INFO("message: " << t.message);
  CHECK(t.status == DDP_ERR_TIMEOUT);
  CHECK(t.message.find("did not complete before the timeout: rank 7 never arrived (key 'never')") != std::string::npos);
  CHECK(s >= 0.29);
  CHECK(s < 1.5);
  // get_many names the key still missing, and its setter.
  st->set("there", bytes("x"), ddp::Deadline::after_ms(5000));
  t = thrown([&] {
    st->get_many({"there", "missing/3"}, ddp::Deadline::after_ms(300),
                 [](const std::string& k) { return "rank " + k.substr(k.find('/') + 1); });
  });
  INFO("message: " << t.message);
  CHECK(t.status == DDP_ERR_TIMEOUT);
  CHECK(t.message.find("rank 3 never arrived (key 'missing/3')") != std::string::npos);
  // The connection goes on.
  CHECK(text(st->get("there", ddp::Deadline::after_ms(5000), "rank 0")) == "x");
}

TEST_CASE("store: a server gone mid-wait fails the wait at once; the store is then given up on within a second") {
  auto server = std::make_unique<ddp::StoreServer>(0);
  const int port = server->port();
  auto st = client(port);
  st->set("a", bytes("1"), ddp::Deadline::after_ms(5000));
  Thrown t;
  double waited = 0;
  std::thread w([&] {
    const auto t0 = std::chrono::steady_clock::now();
    t = thrown([&] { st->get("never", ddp::Deadline::after_ms(30000), "rank 1"); });
    waited = seconds_since(t0);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  server.reset();  // its process died
  w.join();
  INFO("message: " << t.message);
  CHECK(t.status == DDP_ERR_TIMEOUT);
  CHECK(t.message.find("the peer closed the connection") != std::string::npos);
  CHECK(t.message.find("key 'never'") != std::string::npos);
  CHECK(waited < 2);
  // It answered before and now refuses: given up on after a second, not at the call's own bound.
  const auto t0 = std::chrono::steady_clock::now();
  t = thrown([&] { st->set("b", bytes("2"), ddp::Deadline::after_ms(30000)); });
  INFO("message: " << t.message);
  CHECK(t.status == DDP_ERR_ABORTED);
  CHECK(t.message.find("failed earlier, and cannot be reached again") != std::string::npos);
  CHECK(seconds_since(t0) < 2.5);
}

TEST_CASE(
    "store: a client that sends half a frame and falls silent holds up no other; a bad frame ends its connection") {
  ddp::StoreServer server(0);
  const int port = server.port();
  ddp::tcp::Socket half = ddp::tcp::connect_to("127.0.0.1", port, ddp::Deadline::after_ms(5000), "half");
  const uint32_t len = 100;  // announces 100 bytes, sends 10
  char frame[14] = {};
  std::memcpy(frame, &len, 4);
  ddp::tcp::send_all(half, frame, sizeof frame, ddp::Deadline::after_ms(5000), "half");
  auto st = client(port);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 50; ++i) st->set("k" + std::to_string(i), bytes("v"), ddp::Deadline::after_ms(5000));
  CHECK(text(st->get("k49", ddp::Deadline::after_ms(5000), "rank 0")) == "v");
  CHECK(seconds_since(t0) < 2);
  // A frame longer than any request: the server closes that connection, and only that one.
  ddp::tcp::Socket bad = ddp::tcp::connect_to("127.0.0.1", port, ddp::Deadline::after_ms(5000), "bad");
  const uint32_t huge = 0xfffffff0u;
  ddp::tcp::send_all(bad, &huge, 4, ddp::Deadline::after_ms(5000), "bad");
  char c = 0;
  Thrown t = thrown([&] { ddp::tcp::recv_all(bad, &c, 1, ddp::Deadline::after_ms(5000), "bad"); });
  CHECK(t.message.find("the peer closed the connection") != std::string::npos);
  CHECK(text(st->get("k0", ddp::Deadline::after_ms(5000), "rank 0")) == "v");
  CHECK(server.counters().open_connections >= 2);  // the silent one and the client
}
