// A Gloo context's full mesh among the ranks of a communicator, made through the rendezvous store
// under a key of its own; over an elastic membership, given up on by every member as soon as one
// gives up on it (gloo_mesh.cpp).
#pragma once

#include <gloo/rendezvous/context.h>

#include <memory>
#include <string>

#include "backends/gloo/gloo_world.hpp"

namespace ddp {

// A full mesh among `size` ranks of the world (all of them, or the members of an elastic
// membership, renumbered) under the store prefix `key`. `abandoned` (elastic memberships only, else
// empty): the store key a member sets when it gives up on this creation.
std::shared_ptr<gloo::Context> connect_context(const std::shared_ptr<GlooWorld>& w, const std::string& key, Deadline dl,
                                               int rank, int size, const std::string& abandoned);

}  // namespace ddp
