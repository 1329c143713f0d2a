// The operating system's limits a large world meets (host/limits.hpp): a world that needs more open
// files or ports than the process or the kernel gives is refused before any connection, with the
// numbers and the command that fixes it; a soft open-file limit below the hard one is raised instead.
#include <doctest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "core/common.hpp"
#include "host/limits.hpp"

using namespace ddp;

namespace {
std::string refusal(const host::SocketLimits& l, long more, int ranks, long per_rank) {
  try {
    host::check_socket_room(l, more, ranks, per_rank, "Gloo: a world of 4096 ranks");
  } catch (const Error& e) {
    CHECK(e.status() == DDP_ERR_UNSUPPORTED);
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("limits: too few open files or ports is refused with the numbers and the fix") {
  host::SocketLimits l;
  l.open_now = 20, l.soft = 1024, l.hard = 4096, l.port_lo = 32768, l.port_hi = 60999;
  CHECK(refusal(l, 30, 8, 30).empty());
  const std::string files = refusal(l, 4095, 1, 30);
  CHECK(files.find("Gloo: a world of 4096 ranks") != std::string::npos);
  CHECK(files.find("limit is 1024 (hard limit 4096)") != std::string::npos);
  CHECK(files.find("ulimit -n") != std::string::npos);
  const std::string ports = refusal(l, 30, 4096, 4095);
  CHECK(ports.find("ip_local_port_range holds 28232 (32768-60999)") != std::string::npos);
  CHECK(ports.find("sysctl -w net.ipv4.ip_local_port_range") != std::string::npos);
  l.port_lo = l.port_hi = 0;  // unknown range: not checked
  CHECK(refusal(l, 30, 4096, 4095).empty());
}

TEST_CASE("limits: a soft open-file limit below what is needed is raised up to the hard one, or refused") {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    struct rlimit r;
    ::getrlimit(RLIMIT_NOFILE, &r);
    r.rlim_cur = 64;
    r.rlim_max = 4096 < r.rlim_max ? 4096 : r.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_max < 1024) ::_exit(3);
    try {
      host::ensure_socket_room(200, 1, 200, "test");  // raised: 64 -> enough
    } catch (...) {
      ::_exit(1);
    }
    ::getrlimit(RLIMIT_NOFILE, &r);
    if (r.rlim_cur <= 64) ::_exit(2);
    try {
      host::ensure_socket_room(100000, 1, 200, "test");  // past the hard limit: refused
    } catch (const Error& e) {
      ::_exit(std::string(e.what()).find("hard limit") != std::string::npos ? 0 : 4);
    }
    ::_exit(5);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("limits: how many ranks share this host, from the launchers' variables") {
  ::unsetenv("LOCAL_WORLD_SIZE");
  ::unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  ::unsetenv("MPI_LOCALNRANKS");
  ::unsetenv("SLURM_NTASKS_PER_NODE");
  CHECK(host::ranks_on_this_host() == 1);
  ::setenv("SLURM_NTASKS_PER_NODE", "4(x2)", 1);
  CHECK(host::ranks_on_this_host() == 4);
  ::setenv("LOCAL_WORLD_SIZE", "8", 1);
  CHECK(host::ranks_on_this_host() == 8);
  ::unsetenv("LOCAL_WORLD_SIZE");
  ::unsetenv("SLURM_NTASKS_PER_NODE");
}
