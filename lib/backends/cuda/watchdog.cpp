// The watchdog thread: started on first use, it scans every registered item every 5 ms until the
// process exits.
#include "backends/cuda/watchdog.hpp"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

namespace ddp {

namespace {

struct Watchdog {
  std::mutex mu;  // held while registering, unregistering and scanning
  std::vector<Watched*> items;
  bool started = false;

  void loop() {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      std::lock_guard<std::mutex> lock(mu);
      for (Watched* w : items) w->scan();
    }
  }
};

// Never destroyed: the thread runs until the process exits.
Watchdog& watchdog() {
  static Watchdog* w = new Watchdog();
  return *w;
}

}  // namespace

void watchdog_register(Watched* w) {
  Watchdog& d = watchdog();
  std::lock_guard<std::mutex> lock(d.mu);
  d.items.push_back(w);
  if (!d.started) {
    d.started = true;
    std::thread([&d] { d.loop(); }).detach();
  }
}

void watchdog_unregister(Watched* w) {
  Watchdog& d = watchdog();
  std::lock_guard<std::mutex> lock(d.mu);
  d.items.erase(std::remove(d.items.begin(), d.items.end(), w), d.items.end());
}

}  // namespace ddp
