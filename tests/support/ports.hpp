// Ports for tests that meet over loopback: one the kernel hands to bind() now, released at once (a
// store binds it again a moment later).
#pragma once

#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

namespace ddp_test {

// 0 when the kernel gave none.
inline int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 0;
  if (fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  if (fd >= 0) close(fd);
  return port;
}

// How many TCP sockets (listening, connected, connecting or closing; not TIME_WAIT, which a listener
// with SO_REUSEADDR binds over) hold `port` as their local port now, read from /proc/net/tcp{,6};
// `of_this_process` gets how many of them are this process's descriptors. A port chosen for a test may
// already be some client's local port (connect() takes ports from the same range), or become one while
// the test runs: tests that need a port for seconds use this to tell that from a defect of their own.
inline int sockets_holding(int port, int* of_this_process = nullptr) {
  std::set<unsigned long> holders;
  int orphans = 0;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream row(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout;
      unsigned long inode = 0;
      row >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode;
      const auto colon = local.rfind(':');
      if (colon == std::string::npos || std::stoi(local.substr(colon + 1), nullptr, 16) != port) continue;
      if (state == "06") continue;  // TIME_WAIT
      if (inode != 0)
        holders.insert(inode);
      else
        ++orphans;  // closed by its process, not yet gone (FIN_WAIT, LAST_ACK): it still holds the port
    }
  }
  if (of_this_process) {
    *of_this_process = 0;
    if (DIR* fds = opendir("/proc/self/fd")) {
      while (dirent* e = readdir(fds)) {
        char target[64] = {0};
        const std::string path = std::string("/proc/self/fd/") + e->d_name;
        unsigned long inode = 0;
        if (readlink(path.c_str(), target, sizeof target - 1) > 0 && std::sscanf(target, "socket:[%lu]", &inode) == 1 &&
            holders.count(inode))
          ++*of_this_process;
      }
      closedir(fds);
    }
  }
  return static_cast<int>(holders.size()) + orphans;
}

}  // namespace ddp_test
