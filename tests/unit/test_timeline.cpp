// The timeline's files: one per rank, and one per context when a rank has several live contexts in one
// process (a GAN's two models, a teacher and a student), so that no two writers share a file.
#include <doctest.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "ddp.h"

#include <unistd.h>

namespace {

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// A self-comm context writing a timeline to `path`, one grad of 64 floats, `iterations` iterations.
struct TracedContext {
  ddp_t ddp = nullptr;
  std::vector<float> grad = std::vector<float>(64, 1.0f);
  int idx = -1;
  explicit TracedContext(const std::string& path) {
    ddp_comm_t comm = nullptr;
    REQUIRE(ddp_comm_init_self(&comm) == DDP_SUCCESS);
    ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
    cfg.timeline_path = path.c_str();
    REQUIRE(ddp_create(comm, &cfg, &ddp) == DDP_SUCCESS);
    REQUIRE(ddp_comm_destroy(comm) == DDP_SUCCESS);
    REQUIRE(ddp_register_grad(ddp, grad.data(), grad.size(), DDP_F32, 0, &idx) == DDP_SUCCESS);
  }
  void step() {
    REQUIRE(ddp_begin_backward(ddp, nullptr) == DDP_SUCCESS);
    REQUIRE(ddp_grad_ready(ddp, idx) == DDP_SUCCESS);
    REQUIRE(ddp_finish_backward(ddp, nullptr) == DDP_SUCCESS);
  }
  ~TracedContext() { ddp_destroy(ddp); }
};

// A whole trace: "[" first, "]" last, exactly one process name, every event line closed.
void check_whole(const std::string& path, int iterations) {
  const std::string t = slurp(path);
  INFO(path << ":\n" << t);
  REQUIRE(!t.empty());
  CHECK(t.front() == '[');
  CHECK(t.substr(t.size() - 2) == "]\n");
  CHECK(count(t, "\"process_name\"") == 1);
  CHECK(count(t, "\"cat\":\"iteration\"") == static_cast<size_t>(iterations));
}

}  // namespace

TEST_CASE("timeline: two live contexts of one rank write two files, neither mangled") {
  char dir[] = "/tmp/ddp_timeline_XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  const std::string path = std::string(dir) + "/t.json";
  {
    TracedContext a(path), b(path);
    for (int i = 0; i < 3; ++i) a.step(), b.step();
  }
  check_whole(std::string(dir) + "/t.rank0.json", 3);
  check_whole(std::string(dir) + "/t.ctx1.rank0.json", 3);
  SUBCASE("a name is free again once its context is destroyed") {
    {
      TracedContext a(path), b(path);
      a.step(), b.step();
    }
    {
      TracedContext c(path);  // a and b gone: the plain name again, not ".ctx2"
      c.step(), c.step();
    }
    check_whole(std::string(dir) + "/t.rank0.json", 2);
    check_whole(std::string(dir) + "/t.ctx1.rank0.json", 1);
    CHECK_FALSE(std::ifstream(std::string(dir) + "/t.ctx2.rank0.json").good());
  }
  for (const char* f : {"t.rank0.json", "t.ctx1.rank0.json"}) std::remove((std::string(dir) + "/" + f).c_str());
  rmdir(dir);
}
