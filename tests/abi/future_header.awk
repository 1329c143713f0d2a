# Makes the header of a future libddp from today's include/ddp.h: DDP_CONFIG_VERSION one higher, one
# field appended to the end of ddp_config_t, ddp_stats_t and ddp_bucket_info_t, and its default (0)
# to DDP_CONFIG_INITIALIZER. Fails unless all five edits were made, so a change of the header that
# hides one of them stops the build.
/^#define DDP_CONFIG_VERSION [0-9]+u$/ {
  v = $3; sub(/u$/, "", v)
  print "#define DDP_CONFIG_VERSION " (v + 1) "u"
  edits++; next
}
/^} (ddp_config_t|ddp_stats_t|ddp_bucket_info_t);$/ {
  print "  uint64_t future_field; /* appended by a future version: today's library does not know it */"
  edits++
}
/^#define DDP_CONFIG_INITIALIZER/ { initializer = 1 }
initializer && /^  }$/ {
  print "        , 0 /* future_field */ \\"
  initializer = 0; edits++
}
{ print }
END { if (edits != 5) { print "future_header.awk: made " edits " of 5 edits" > "/dev/stderr"; exit 1 } }
