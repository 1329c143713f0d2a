// What the opaque handles of ddp.h are inside the library.
#pragma once

#include <memory>

#include "core/backend.hpp"
#include "core/context.hpp"
#include "core/comms.hpp"

struct ddp_comm {
  std::unique_ptr<ddp::Comm> impl;
  ddp::Comm* borrowed = nullptr;  // a comm hook's bucket->comm: the context's, valid during the call
  ddp::Comm& get() const { return borrowed ? *borrowed : *impl; }
};

struct ddp_local_group {
  std::shared_ptr<ddp::LocalGroup> impl;  // comms made from it share it, so destroy can come first
};

struct ddp_context {
  std::unique_ptr<ddp::Context> impl;
};
