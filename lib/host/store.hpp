// The key-value store through which ranks that share no MPI find each other: a TCP server that every
// rank reaches (host/store_tcp.hpp), or a directory on a shared file system (host/store_file.cpp).
// The init methods that name one, and the ranks' arrival through it: host/rendezvous.hpp.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/common.hpp"

namespace ddp {

class Store {
 public:
  // Who sets a key, for the message of a wait that timed out ("rank 3").
  using Who = std::function<std::string(const std::string& key)>;
  // What a caller last saw of a key: not set, or set to `value`.
  struct Seen {
    bool set = false;
    std::vector<char> value;
  };

  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<char>& value, Deadline dl) = 0;
  // Waits until `key` is set, then returns its value. Throws DDP_ERR_TIMEOUT at the deadline,
  // saying that `who` never set it.
  virtual std::vector<char> get(const std::string& key, Deadline dl, const std::string& who) = 0;
  // Sets `key` to `value` unless it is set already, atomically among the ranks: true when this call
  // set it; false, with the value it holds in *held, when it was set before.
  virtual bool claim(const std::string& key, const std::vector<char>& value, std::vector<char>* held, Deadline dl) = 0;
  // The value of `key` if it is set now, without waiting.
  virtual bool try_get(const std::string& key, std::vector<char>* out, Deadline dl) = 0;
  // Forgets a key (a file store's files would otherwise outlive the job).
  virtual void erase(const std::string& key) {}

  // Waits until every key is set and returns their values, in order; DDP_ERR_TIMEOUT at the deadline
  // names a key still missing and who(key). The TCP store asks once for all of them; the others get
  // them one by one.
  virtual std::vector<std::vector<char>> get_many(const std::vector<std::string>& keys, Deadline dl, const Who& who);
  std::vector<std::vector<char>> get_many(const std::vector<std::string>& keys, Deadline dl, const std::string& who);
  // get_many without the values: for a caller that only needs to know that they are there.
  virtual void wait(const std::vector<std::string>& keys, Deadline dl, const Who& who);

  // Waits until one of `keys` differs from what the caller saw of it ((*seen)[i]: set or not, and the
  // value), then puts what every key holds now in *seen and returns true. False, *seen untouched, at
  // `dl` or once `*stop` (may be NULL) is true: interrupt() makes a wait look at its `stop` at once.
  // The TCP store's server answers when a key changes (nothing is sent meanwhile); the other stores
  // look again every `look_ms`.
  virtual bool watch(const std::vector<std::string>& keys, std::vector<Seen>* seen, Deadline dl,
                     const std::atomic<bool>* stop = nullptr, int look_ms = 10);
  // watch of one key.
  bool wait_change(const std::string& key, Seen* seen, Deadline dl, const std::atomic<bool>* stop = nullptr,
                   int look_ms = 10);
  // Wakes the watches under way on this store, from any thread, so that each looks at its `stop`.
  virtual void interrupt() {}
};

// The store of a directory that every rank sees ("file:///DIR"): keys are its files.
std::shared_ptr<Store> open_file_store(const std::string& dir);

}  // namespace ddp
