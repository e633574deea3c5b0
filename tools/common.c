/* Small helpers the tool's subcommands share: a monotonic clock, a
 * comparison for qsort of timings, JSON strings. */
#include <stdio.h>
#include <time.h>

#include "tool.h"

double tool_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int compare_doubles(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* '<', '>' and '&' are escaped too, so that the string is safe inside an
 * HTML <script> (no "</script>"). */
void json_put_string(FILE *f, const char *s) {
  fputc('"', f);
  for (; s && *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
    else if (c < 0x20 || c == '<' || c == '>' || c == '&') fprintf(f, "\\u%04x", c);
    else fputc(c, f);
  }
  fputc('"', f);
}
