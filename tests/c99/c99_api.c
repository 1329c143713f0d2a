/* The header compiles as strict C99 (-std=c99 -pedantic -Wall -Wextra -Werror), and the API is
 * usable from plain C: a world-size-1 context through a whole iteration, plus misuse answered with
 * statuses. Prints "c99: N passed, N failed". */
#include <stdio.h>
#include <string.h>

#include "ddp.h"

static int passed = 0, failed = 0;

static void check(int ok, const char* what) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    printf("c99: FAIL %s (last error: %s)\n", what, ddp_last_error());
  }
}

int main(void) {
  ddp_comm_t comm = NULL;
  ddp_t ddp = NULL;
  ddp_config_t cfg = DDP_CONFIG_INITIALIZER;
  ddp_stats_t stats;
  float w[64];
  double b[5];
  int iw = -1, ib = -1, i, nb = 0, learned = -1;

  check(ddp_comm_init_self(&comm) == DDP_SUCCESS, "ddp_comm_init_self");
  cfg.message_size = 16;
  cfg.gradient_predivide_factor = 2.0;
  cfg.gradient_average = 0;
  check(ddp_create(comm, &cfg, &ddp) == DDP_SUCCESS, "ddp_create");
  check(ddp_register_grad(ddp, w, 64, DDP_F32, 0, &iw) == DDP_SUCCESS && iw == 0, "register w");
  check(ddp_register_grad(ddp, b, 5, DDP_F64, DDP_GRAD_TRIGGER, &ib) == DDP_SUCCESS && ib == 1, "register b");
  for (i = 0; i < 64; ++i) w[i] = (float)i;
  for (i = 0; i < 5; ++i) b[i] = 1.0 + i;
  check(ddp_begin_backward(ddp, NULL) == DDP_SUCCESS, "begin");
  check(ddp_grad_ready(ddp, ib) == DDP_SUCCESS, "ready b");
  check(ddp_grad_ready(ddp, iw) == DDP_SUCCESS, "ready w");
  check(ddp_finish_backward(ddp, NULL) == DDP_SUCCESS, "finish");
  check(w[10] == 5.0f && b[4] == 2.5, "sum divided by the predivide factor on one rank");
  check(ddp_get_plan(ddp, &nb, &learned) == DDP_SUCCESS && nb == 2 && learned == 1, "plan");
  memset(&stats, 0, sizeof stats);
  stats.size = sizeof stats;
  check(ddp_get_stats(ddp, &stats) == DDP_SUCCESS && stats.iterations == 1 && stats.buckets_reduced == 2, "stats");

  /* misuse from C */
  check(ddp_grad_ready(ddp, 0) == DDP_ERR_INVALID_STATE, "ready outside backward");
  check(strstr(ddp_last_error(), "ddp_begin_backward") != NULL, "message names the fix");
  check(ddp_grad_ready(NULL, 0) == DDP_ERR_INVALID_ARGUMENT, "NULL handle");
  check(strcmp(ddp_status_string(DDP_ERR_MISMATCH), "ranks disagree") == 0, "status string");
  check(ddp_comm_init_nccl(NULL, 1, 0, 0, &comm) == DDP_ERR_INVALID_ARGUMENT, "NULL nccl id");

  check(ddp_destroy(ddp) == DDP_SUCCESS, "destroy");
  check(ddp_comm_destroy(comm) == DDP_SUCCESS, "comm destroy");
  check(ddp_destroy(NULL) == DDP_SUCCESS, "destroy NULL");
  printf("c99: %d passed, %d failed\n", passed, failed);
  return failed != 0;
}
