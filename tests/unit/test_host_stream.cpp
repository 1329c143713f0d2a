// The host stream's waits (lib/host/host_device.cpp, HostStream::drain): the peer watch of elastic
// contexts asks while a task is blocked in a collective, never while it computes, and what it does
// (a rank that gives up on a dead peer closes its connections) ends the wait long before the deadline;
// the stall warning comes once per task.
#include <doctest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "core/common.hpp"
#include "host/host_device.hpp"

using namespace ddp;

namespace {

// A task that waits like a collective on a peer (inside a BlockingCall) until released, or computes
// (outside one) for `compute_ms`.
struct Waiting final : Task {
  std::atomic<bool>* release;
  bool blocked;
  int compute_ms;
  void run() override {
    if (!blocked) {
      std::this_thread::sleep_for(std::chrono::milliseconds(compute_ms));
      return;
    }
    host::BlockingCall call;
    while (!release->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
};

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST_CASE("host stream: the peer watch asks while a collective waits, and giving up on a peer ends the wait") {
  HostDevice dev;
  std::unique_ptr<Stream> s = dev.make_stream(0);
  std::atomic<bool> release{false};
  std::atomic<int> asked{0};
  // The second ask finds the peer gone and "closes the connections": the collective returns.
  s->set_peer_watch(50, [&] {
    if (++asked == 2) release = true;
  });
  Waiting t;
  t.release = &release;
  t.blocked = true;
  t.compute_ms = 0;
  const auto t0 = std::chrono::steady_clock::now();
  s->submit(&t);
  CHECK_NOTHROW(s->drain(Deadline::after_ms(20000)));
  const double took = ms_since(t0);
  CHECK(asked.load() == 2);
  CHECK(took >= 90);
  CHECK(took < 5000);  // without the watch: 20 s, then DDP_ERR_TIMEOUT
}

TEST_CASE("host stream: the peer watch never asks while a task computes, nor when it is off") {
  HostDevice dev;
  std::unique_ptr<Stream> s = dev.make_stream(0);
  std::atomic<bool> release{true};
  std::atomic<int> asked{0};
  s->set_peer_watch(20, [&] { ++asked; });
  Waiting t;
  t.release = &release;
  t.blocked = false;
  t.compute_ms = 200;
  s->submit(&t);
  CHECK_NOTHROW(s->drain(Deadline::after_ms(20000)));
  CHECK(asked.load() == 0);
  // Off (0 ms): a blocked task waits for its release alone.
  std::unique_ptr<Stream> quiet = dev.make_stream(1);
  quiet->set_peer_watch(0, [&] { ++asked; });
  std::atomic<bool> later{false};
  Waiting b;
  b.release = &later;
  b.blocked = true;
  b.compute_ms = 0;
  quiet->submit(&b);
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    later = true;
  });
  CHECK_NOTHROW(quiet->drain(Deadline::after_ms(20000)));
  releaser.join();
  CHECK(asked.load() == 0);
}

TEST_CASE("host stream: a blocked task past the deadline is DDP_ERR_TIMEOUT, the watch asking all along") {
  HostDevice dev;
  std::unique_ptr<Stream> s = dev.make_stream(0);
  std::atomic<bool> release{false};
  std::atomic<int> asked{0};
  s->set_peer_watch(30, [&] { ++asked; });  // every peer answers: nothing to give up on
  Waiting t;
  t.release = &release;
  t.blocked = true;
  t.compute_ms = 0;
  s->submit(&t);
  bool timed_out = false;
  try {
    s->drain(Deadline::after_ms(300));
  } catch (const Error& e) {
    timed_out = e.status() == DDP_ERR_TIMEOUT;
  }
  CHECK(timed_out);
  CHECK(asked.load() >= 5);
  release = true;  // lets the worker leave; the stream wrote nothing off (the deadline is the caller's)
  CHECK_NOTHROW(s->drain(Deadline::after_ms(5000)));
}
