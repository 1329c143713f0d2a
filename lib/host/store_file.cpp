// The file store: keys are files of one directory on a file system that every rank sees, written
// under a temporary name and renamed, so that a reader never sees half a value. Waits look again
// every 10 ms (a file system has nothing to wait on).
#include "host/store.hpp"

#include <unistd.h>

#include <errno.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>

namespace ddp {

namespace {

class FileStore final : public Store {
 public:
  explicit FileStore(std::string dir) : dir_(std::move(dir)) {}
  void set(const std::string& key, const std::vector<char>& value, Deadline) override {
    const std::string path = file(key), tmp = write_tmp(path, value);
    if (std::rename(tmp.c_str(), path.c_str()) != 0)
      fail(DDP_ERR_INVALID_ARGUMENT, "the rendezvous directory %s: cannot rename %s", dir_.c_str(), tmp.c_str());
  }
  // A hard link is made only where no file is: the first claim wins.
  bool claim(const std::string& key, const std::vector<char>& value, std::vector<char>* held, Deadline dl) override {
    const std::string path = file(key), tmp = write_tmp(path, value);
    const bool won = ::link(tmp.c_str(), path.c_str()) == 0;
    const int err = errno;
    std::remove(tmp.c_str());
    if (won) return true;
    if (err != EEXIST)
      fail(DDP_ERR_INVALID_ARGUMENT, "the rendezvous directory %s: cannot create %s: %s", dir_.c_str(), path.c_str(),
           std::strerror(err));
    held->clear();
    try_get(key, held, dl);
    return false;
  }
  bool try_get(const std::string& key, std::vector<char>* out, Deadline) override {
    std::ifstream f(file(key), std::ios::binary);
    if (!f) return false;
    *out = std::vector<char>(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    return true;
  }
  std::vector<char> get(const std::string& key, Deadline dl, const std::string& who) override {
    std::vector<char> v;
    for (;;) {
      if (try_get(key, &v, dl)) return v;
      if (dl.passed())
        fail(DDP_ERR_TIMEOUT, "the rendezvous in %s did not complete before the timeout: %s never arrived (no file %s)",
             dir_.c_str(), who.c_str(), file(key).c_str());
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  void erase(const std::string& key) override { std::remove(file(key).c_str()); }

 private:
  std::string file(const std::string& key) const {
    std::string k = key;
    for (char& c : k)
      if (c == '/') c = '.';
    return dir_ + "/" + k;
  }
  // The value under a temporary name, so that a reader never sees half a value.
  std::string write_tmp(const std::string& path, const std::vector<char>& value) const {
    static std::atomic<unsigned> seq{0};  // ranks that are threads of one process write at once
    const std::string tmp = path + ".tmp" + std::to_string(::getpid()) + "." + std::to_string(seq++);
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(value.data(), static_cast<std::streamsize>(value.size()));
    if (!f) fail(DDP_ERR_INVALID_ARGUMENT, "the rendezvous directory %s: cannot write %s", dir_.c_str(), tmp.c_str());
    return tmp;
  }
  std::string dir_;
};
}  // namespace

std::shared_ptr<Store> open_file_store(const std::string& dir) { return std::make_shared<FileStore>(dir); }

}  // namespace ddp
