// The operating system's limits that a large world meets first, checked before connections are
// made rather than discovered as a failed socket() or bind() half way: the process's open-file limit
// (RLIMIT_NOFILE, `ulimit -n`) and the kernel's range of ports for connections
// (/proc/sys/net/ipv4/ip_local_port_range). docs/design.md, "The control plane at scale".
#pragma once

#include <string>

namespace ddp {
namespace host {

struct SocketLimits {
  long open_now = 0;             // descriptors open in this process
  long soft = 0, hard = 0;       // RLIMIT_NOFILE
  int port_lo = 0, port_hi = 0;  // the kernel's range (0, 0: unknown)
};
SocketLimits socket_limits();

// This process is about to hold `more` sockets besides those it has, and `ranks_on_host` processes
// of the job, each about `per_rank` connections, share this host's ports. Raises the soft open-file
// limit up to the hard one where that is enough (said in the log); otherwise refuses with
// DDP_ERR_UNSUPPORTED, giving the numbers and the command that fixes it. `what` names the need.
void ensure_socket_room(long more, int ranks_on_host, long per_rank, const std::string& what);
// The same from explicit limits (for tests): throws as ensure_socket_room does, without raising.
void check_socket_room(const SocketLimits& l, long more, int ranks_on_host, long per_rank, const std::string& what);

// How many ranks of this job share this host, from the launcher's variables (LOCAL_WORLD_SIZE,
// OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS, SLURM_NTASKS_PER_NODE); 1 when none says.
int ranks_on_this_host();

}  // namespace host
}  // namespace ddp
