// The library's log: warnings when something is wrong (a stall), information when DDP_DEBUG=INFO
// asks for it. Messages go to the user's callback (ddp_set_log_callback) or, by default, to stderr.
#pragma once

#include <string>

#include "core/common.hpp"

namespace ddp {

enum class DebugLevel { Warn, Off, Info };

// Reads a DDP_DEBUG value: INFO, WARN or WARNING, OFF or NONE, in any case; NULL or "" is the default
// (Warn). Any other value sets Warn and returns false: log_enabled then warns once, through the log,
// with unknown_debug_message(value), which names the accepted values.
bool parse_debug_level(const char* value, DebugLevel* level);
std::string unknown_debug_message(const std::string& value);

void set_log_callback(ddp_log_fn fn, void* user);
// Whether messages of `level` go anywhere (a callback is set, or DDP_DEBUG lets the default print).
bool log_enabled(ddp_log_level_t level);
void log(ddp_log_level_t level, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

}  // namespace ddp
