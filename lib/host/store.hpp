// The key-value store through which ranks that share no MPI find each other: a TCP server that every
// rank reaches (host/store_tcp.hpp), or a directory on a shared file system (host/store_file.cpp).
// The init methods that name one, and the ranks' arrival through it: host/rendezvous.hpp.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/common.hpp"

namespace ddp {

class Store {
 public:
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
};

// The store of a directory that every rank sees ("file:///DIR"): keys are its files.
std::shared_ptr<Store> open_file_store(const std::string& dir);

}  // namespace ddp
