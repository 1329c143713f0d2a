// Runs a test body on in-process ranks: one thread per rank of a local group.
#pragma once

#include <doctest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "ddp.h"

// Runs fn(rank, comm) on `n` threads over one local group; returns the number of ranks that failed.
template <class F>
int on_ranks(int n, F fn) {
  ddp_local_group_t g;
  REQUIRE(ddp_local_group_create(n, &g) == DDP_SUCCESS);
  std::atomic<int> failed{0};
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      ddp_comm_t c;
      if (ddp_comm_init_local(g, r, &c) != DDP_SUCCESS) {
        ++failed;
        return;
      }
      if (!fn(r, c)) ++failed;
      ddp_comm_destroy(c);
    });
  for (auto& t : ts) t.join();
  ddp_local_group_destroy(g);
  return failed.load();
}
