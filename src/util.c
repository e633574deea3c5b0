/* Small text helpers shared by the backends, the configuration and messages:
 * reading sizes with units, and writing sizes the way PyTorch's messages do.
 */
#include <ctype.h>
#include <stdarg.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static bool unit_factor(const char *u, size_t len, double *factor) {
  static const struct { const char *name; double factor; } units[] = {
      {"", 1.0},
      {"B", 1.0},
      {"KiB", 1024.0},
      {"MiB", 1024.0 * 1024},
      {"GiB", 1024.0 * 1024 * 1024},
      {"TiB", 1024.0 * 1024 * 1024 * 1024},
      {"K", 1024.0},
      {"M", 1024.0 * 1024},
      {"G", 1024.0 * 1024 * 1024},
      {"T", 1024.0 * 1024 * 1024 * 1024},
      {"KB", 1e3},
      {"MB", 1e6},
      {"GB", 1e9},
      {"TB", 1e12},
  };
  for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
    if (strlen(units[i].name) == len && strncmp(units[i].name, u, len) == 0) {
      *factor = units[i].factor;
      return true;
    }
  }
  return false;
}

void text_put(text_t *t, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  size_t room = t->len < t->cap ? t->cap - t->len : 0;
  int n = vsnprintf(room ? t->buf + t->len : NULL, room, fmt, ap);
  va_end(ap);
  if (n > 0) t->len += (size_t)n;
}

void *grow_array(void *array, size_t *cap, size_t elem_size, size_t first) {
  size_t n = *cap ? 2 * *cap : first;
  if (n < *cap || n > SIZE_MAX / elem_size) return NULL;
  void *grown = realloc(array, n * elem_size);
  if (grown) *cap = n;
  return grown;
}

bool parse_size(const char *text, size_t len, uint64_t *out) {
  size_t i = 0;
  while (i < len && isspace((unsigned char)text[i])) i++;
  size_t digits_start = i;
  uint64_t whole = 0;
  bool overflow = false;
  while (i < len && isdigit((unsigned char)text[i])) {
    unsigned d = (unsigned)(text[i] - '0');
    if (whole > (UINT64_MAX - d) / 10) overflow = true;
    whole = whole * 10 + d;
    i++;
  }
  double frac = 0.0, scale = 0.1;
  bool has_frac = false;
  if (i < len && text[i] == '.') {
    i++;
    while (i < len && isdigit((unsigned char)text[i])) {
      frac += (text[i] - '0') * scale;
      scale /= 10;
      has_frac = true;
      i++;
    }
  }
  if (i == digits_start || overflow) return false;
  size_t unit_start = i;
  size_t unit_end = len;
  while (unit_end > unit_start && isspace((unsigned char)text[unit_end - 1])) unit_end--;
  double factor;
  if (!unit_factor(text + unit_start, unit_end - unit_start, &factor)) return false;
  if (!has_frac && factor == floor(factor) && factor <= 1e12) {
    uint64_t f = (uint64_t)factor;
    if (f != 0 && whole > UINT64_MAX / f) return false;
    *out = whole * f;
    return true;
  }
  double v = ((double)whole + frac) * factor;
  if (!(v < 18446744073709551615.0) || v < 0) return false;
  *out = (uint64_t)v;
  return true;
}

void format_bytes(uint64_t bytes, char *buf, size_t cap) {
  if (bytes < 1024) {
    snprintf(buf, cap, "%llu bytes", (unsigned long long)bytes);
    return;
  }
  static const char *const units[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = (double)bytes / 1024.0;
  size_t u = 0;
  while (v >= 1024.0 && u + 1 < sizeof units / sizeof units[0]) {
    v /= 1024.0;
    u++;
  }
  snprintf(buf, cap, "%.2f %s", v, units[u]);
}
