#include "host/limits.hpp"

#include <dirent.h>
#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>

#include "core/common.hpp"
#include "core/log.hpp"

namespace ddp {
namespace host {

namespace {

long count_open_fds() {
  long n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d)) ++n;
    ::closedir(d);
    n -= 3;  // ".", ".." and the directory's own descriptor
  }
  return n < 0 ? 0 : n;
}

// Ports a connection may take on this host: what the range holds, less the ones below 1024 never in it.
long range_size(const SocketLimits& l) {
  return l.port_hi >= l.port_lo && l.port_lo > 0 ? l.port_hi - l.port_lo + 1 : 0;
}

}  // namespace

SocketLimits socket_limits() {
  SocketLimits l;
  l.open_now = count_open_fds();
  struct rlimit r;
  if (::getrlimit(RLIMIT_NOFILE, &r) == 0) {
    l.soft = r.rlim_cur == RLIM_INFINITY ? (1L << 30) : static_cast<long>(r.rlim_cur);
    l.hard = r.rlim_max == RLIM_INFINITY ? (1L << 30) : static_cast<long>(r.rlim_max);
  }
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d %d", &l.port_lo, &l.port_hi) != 2) l.port_lo = l.port_hi = 0;
    std::fclose(f);
  }
  return l;
}

// Each new connection is one descriptor here and, while it is made, a listening one more; the
// margin (32) covers the store's connection, the stall inspector's port and what Gloo's device holds.
void check_socket_room(const SocketLimits& l, long more, int ranks_on_host, long per_rank, const std::string& what) {
  const long need = l.open_now + 2 * more + 32;
  if (l.soft > 0 && need > l.soft)
    fail(DDP_ERR_UNSUPPORTED,
         "%s: this process would hold about %ld open files (%ld now, and 2 per connection while it is made), but "
         "its limit is %ld (hard limit %ld): raise it before starting the job (ulimit -n %ld; in a systemd unit "
         "LimitNOFILE=%ld; in a container --ulimit nofile=%ld)",
         what.c_str(), need, l.open_now, l.soft, l.hard, need * 2, need * 2, need * 2);
  const long ports = static_cast<long>(ranks_on_host) * per_rank * 3 / 2;
  const long range = range_size(l);
  if (range > 0 && ports > range)
    fail(DDP_ERR_UNSUPPORTED,
         "%s: %d ranks on this host with about %ld connections each need about %ld ports, but the kernel's "
         "ip_local_port_range holds %ld (%d-%d): widen it (sysctl -w net.ipv4.ip_local_port_range=\"1024 65535\"), or "
         "put fewer ranks on each host",
         what.c_str(), ranks_on_host, per_rank, ports, range, l.port_lo, l.port_hi);
}

void ensure_socket_room(long more, int ranks_on_host, long per_rank, const std::string& what) {
  SocketLimits l = socket_limits();
  const long need = l.open_now + 2 * more + 32;
  if (l.soft > 0 && need > l.soft && need <= l.hard) {
    struct rlimit r;
    ::getrlimit(RLIMIT_NOFILE, &r);
    r.rlim_cur = static_cast<rlim_t>(std::min(l.hard, std::max(need * 2, l.soft)));
    if (::setrlimit(RLIMIT_NOFILE, &r) == 0) {
      log(DDP_LOG_INFO, "libddp: %s: the open-file limit was %ld, raised to %ld (its hard limit is %ld)", what.c_str(),
          l.soft, static_cast<long>(r.rlim_cur), l.hard);
      l.soft = static_cast<long>(r.rlim_cur);
    }
  }
  check_socket_room(l, more, ranks_on_host, per_rank, what);
}

int ranks_on_this_host() {
  for (const char* v : {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"}) {
    const char* s = std::getenv(v);
    if (!s || !*s) continue;
    char* end = nullptr;
    const long n = std::strtol(s, &end, 10);  // (SLURM_NTASKS_PER_NODE may read "4(x2)": its first count)
    if (end != s && n > 0 && n < (1L << 20)) return static_cast<int>(n);
  }
  return 1;
}

}  // namespace host
}  // namespace ddp
