// For the store's tests: a TCP store server of a test's own, its clients, and small helpers.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "host/store_tcp.hpp"

namespace store_test {

inline std::vector<char> bytes(const std::string& s) { return std::vector<char>(s.begin(), s.end()); }
inline std::string text(const std::vector<char>& v) { return std::string(v.begin(), v.end()); }

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A client of the store on `port` of this host: a connection of its own.
inline std::shared_ptr<ddp::Store> client(int port) {
  std::string local;
  return ddp::open_tcp_store("127.0.0.1", port, false, "a test client", ddp::Deadline::after_ms(10000), &local);
}

// What a call threw: its status and message (DDP_SUCCESS when it returned).
struct Thrown {
  ddp_status_t status = DDP_SUCCESS;
  std::string message;
};
template <class F>
Thrown thrown(F&& f) {
  Thrown t;
  try {
    f();
  } catch (const ddp::Error& e) {
    t.status = e.status();
    t.message = e.what();
  }
  return t;
}

}  // namespace store_test
