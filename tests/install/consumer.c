/* Built against an installed libddp (CMake package or pkg-config): one reduction over the self comm. */
#include <stdio.h>

#include "ddp.h"

#define CHECK(call)                                                                              \
  do {                                                                                           \
    ddp_status_t s_ = (call);                                                                    \
    if (s_ != DDP_SUCCESS) {                                                                     \
      fprintf(stderr, "consumer: %s: %s: %s\n", #call, ddp_status_string(s_), ddp_last_error()); \
      return 1;                                                                                  \
    }                                                                                            \
  } while (0)

int main(void) {
  float g[3] = {1.0f, 2.0f, 3.0f};
  ddp_comm_t comm;
  ddp_t ddp;
  ddp_config_t cfg;
  int i;
  if (ddp_version() != DDP_VERSION_CODE) {
    fprintf(stderr, "consumer: header %d, library %d\n", DDP_VERSION_CODE, ddp_version());
    return 1;
  }
  CHECK(ddp_comm_init_self(&comm));
  CHECK(ddp_config_init(&cfg));
  CHECK(ddp_create(comm, &cfg, &ddp));
  CHECK(ddp_register_grad(ddp, g, 3, DDP_F32, 0, &i));
  CHECK(ddp_begin_backward(ddp, NULL));
  CHECK(ddp_grad_ready(ddp, i));
  CHECK(ddp_finish_backward(ddp, NULL));
  CHECK(ddp_destroy(ddp));
  CHECK(ddp_comm_destroy(comm));
  if (g[0] != 1.0f || g[2] != 3.0f) return 1;
  printf("consumer: ok (libddp %d)\n", ddp_version());
  return 0;
}
