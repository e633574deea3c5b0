/* Small text helpers shared by the backends, the configuration and messages:
 * reading sizes with units, and writing sizes the way PyTorch's messages do.
 */
#include <ctype.h>
#include <stdarg.h>
#include <math.h>
#include <stdio.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "base/base.h"

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

void gca__text_put(text_t *t, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  size_t room = t->len < t->cap ? t->cap - t->len : 0;
  int n = vsnprintf(room ? t->buf + t->len : NULL, room, fmt, ap);
  va_end(ap);
  if (n > 0) t->len += (size_t)n;
}

uint64_t gca__bytes_hash(const void *data, size_t len) {
  const unsigned char *c = data;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < len; i++) h = (h ^ c[i]) * 1099511628211ull;
  return h;
}

uint64_t gca__text_hash(const char *s) {
  uint64_t h = gca__bytes_hash(s, strlen(s));
  return h ? h : 1;
}

void *gca__grow_array(void *array, size_t *cap, size_t elem_size, size_t first) {
  size_t n = *cap ? 2 * *cap : first;
  if (n < *cap || n > SIZE_MAX / elem_size) return NULL;
  void *grown = realloc(array, n * elem_size);
  if (grown) *cap = n;
  return grown;
}

/* A mapping is zero-filled; the huge pages need it aligned to 2 MiB, so map
 * one more and trim. */
void *gca__huge_map(size_t bytes) {
  size_t span = bytes + HUGE_PAGE_BYTES;
  if (span < bytes) return NULL;
  char *raw = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return NULL;
  char *p = (char *)(((uintptr_t)raw + HUGE_PAGE_BYTES - 1) & ~(uintptr_t)(HUGE_PAGE_BYTES - 1));
  if (p > raw) munmap(raw, (size_t)(p - raw));
  if (raw + span > p + bytes) munmap(p + bytes, (size_t)(raw + span - (p + bytes)));
#ifdef MADV_HUGEPAGE
  (void)madvise(p, bytes, MADV_HUGEPAGE); /* advice only: without huge pages it works as before */
#endif
  return p;
}

struct arena_chunk {
  struct arena_chunk *next;
  size_t used, cap;
  _Alignas(16) char data[];
};

void *gca__arena_alloc(arena_t *ar, size_t n) {
  n = (n + 15) & ~(size_t)15;
  if (!ar->head || ar->head->cap - ar->head->used < n) {
    size_t chunk = ar->chunk ? ar->chunk : 65536;
    size_t cap = n > chunk ? n : chunk;
    if (ar->limit && cap > ar->limit - ar->bytes) {
      ar->failed = ar->over_limit = true;
      return NULL;
    }
    arena_chunk_t *c;
    if (ar->chunk_alloc) {
      if (ar->chunk_round) cap = (sizeof *c + cap + ar->chunk_round - 1) / ar->chunk_round * ar->chunk_round - sizeof *c;
      c = ar->chunk_alloc(sizeof *c + cap);
    } else
      c = malloc(sizeof *c + cap);
    if (!c) {
      ar->failed = true;
      return NULL;
    }
    c->next = ar->head;
    c->used = 0;
    c->cap = cap;
    ar->head = c;
    ar->bytes += cap;
  }
  void *p = ar->head->data + ar->head->used;
  ar->head->used += n;
  return p;
}

bool gca__arena_extend(arena_t *ar, void *p, size_t old_n, size_t new_n) {
  arena_chunk_t *c = ar->head;
  old_n = (old_n + 15) & ~(size_t)15;
  new_n = (new_n + 15) & ~(size_t)15;
  if (!c || !p || new_n < old_n || (char *)p + old_n != c->data + c->used || new_n - old_n > c->cap - c->used)
    return false;
  c->used += new_n - old_n;
  return true;
}

void *gca__arena_zalloc(arena_t *ar, size_t n) {
  void *p = gca__arena_alloc(ar, n);
  if (p) memset(p, 0, n);
  return p;
}

char *gca__arena_strdup(arena_t *ar, const char *s) {
  size_t n = strlen(s) + 1;
  char *p = gca__arena_alloc(ar, n);
  if (p) memcpy(p, s, n);
  return p;
}

void gca__arena_free(arena_t *ar) {
  while (ar->head) {
    arena_chunk_t *next = ar->head->next;
    if (ar->chunk_free) ar->chunk_free(ar->head, sizeof *ar->head + ar->head->cap);
    else
      free(ar->head);
    ar->head = next;
  }
  ar->bytes = 0;
}

/* Fibonacci hashing: the product's top bits, which every bit of the key
 * reaches. (Device addresses differ in high bits: blocks at the same offset
 * of segments 128 MiB apart agree in their low 27.) */
static size_t addr_map_home(const addr_map_t *m, uint64_t stored) {
  return (size_t)((stored * 0x9E3779B97F4A7C15ull) >> (64 - __builtin_ctzll(m->cap)));
}

static size_t addr_map_slot(const addr_map_t *m, uint64_t stored) {
  size_t i = addr_map_home(m, stored);
  while (m->keys[i] && m->keys[i] != stored) i = (i + 1) & (m->cap - 1);
  return i;
}

/* Rehash into a table four times the live entries (at least 1024): it
 * grows as entries come, and stays put when deletions churn. */
static bool addr_map_rehash(addr_map_t *m) {
  size_t live = 0, cap = 1024;
  for (size_t i = 0; i < m->cap; i++) live += m->keys[i] && m->keys[i] != ADDR_MAP_DELETED;
  while (cap < 4 * (live + 1)) cap *= 2;
  addr_map_t bigger = {calloc(cap, sizeof(uint64_t)), malloc(cap * sizeof(uint64_t)), cap, 0};
  if (!bigger.keys || !bigger.vals) {
    free(bigger.keys);
    free(bigger.vals);
    return false;
  }
  for (size_t i = 0; i < m->cap; i++) {
    if (!m->keys[i] || m->keys[i] == ADDR_MAP_DELETED) continue;
    size_t j = addr_map_slot(&bigger, m->keys[i]);
    bigger.keys[j] = m->keys[i];
    bigger.vals[j] = m->vals[i];
    bigger.used++;
  }
  gca__addr_map_free(m);
  *m = bigger;
  return true;
}

bool gca__addr_map_init(addr_map_t *m) {
  *m = (addr_map_t){calloc(1024, sizeof(uint64_t)), malloc(1024 * sizeof(uint64_t)), 1024, 0};
  if (m->keys && m->vals) return true;
  gca__addr_map_free(m);
  return false;
}

uint64_t *gca__addr_map_get(const addr_map_t *m, uint64_t key) {
  size_t i = addr_map_slot(m, key + 1);
  return m->keys[i] ? &m->vals[i] : NULL;
}

bool gca__addr_map_put(addr_map_t *m, uint64_t key, uint64_t val) {
  uint64_t stored = key + 1;
  size_t i = addr_map_home(m, stored), deleted = SIZE_MAX;
  for (; m->keys[i]; i = (i + 1) & (m->cap - 1)) {
    if (m->keys[i] == stored) {
      m->vals[i] = val;
      return true;
    }
    if (m->keys[i] == ADDR_MAP_DELETED && deleted == SIZE_MAX) deleted = i;
  }
  /* A new key takes the first deleted slot on its path: an address freed
   * and allocated again and again (what a caching allocator does) would
   * otherwise leave a trail of deleted slots that every lookup walks. */
  if (deleted != SIZE_MAX) {
    i = deleted;
  } else if ((m->used + 1) * 2 > m->cap) {
    /* Deleted slots also count in `used` until a rehash drops them. */
    if (!addr_map_rehash(m)) return false;
    i = addr_map_slot(m, stored);
    m->used++;
  } else {
    m->used++;
  }
  m->keys[i] = stored;
  m->vals[i] = val;
  return true;
}

void gca__addr_map_del(addr_map_t *m, uint64_t key) {
  size_t i = addr_map_slot(m, key + 1);
  if (m->keys[i]) m->keys[i] = ADDR_MAP_DELETED;
}

void gca__addr_map_free(addr_map_t *m) {
  free(m->keys);
  free(m->vals);
  *m = (addr_map_t){0};
}

size_t gca__parse_decimal(const char *text, size_t len, uint64_t *out) {
  uint64_t v = 0;
  size_t i = 0;
  for (; i < len && text[i] >= '0' && text[i] <= '9'; i++) {
    unsigned d = (unsigned)(text[i] - '0');
    if (v > (UINT64_MAX - d) / 10) return 0;
    v = v * 10 + d;
  }
  if (i) *out = v;
  return i;
}

bool gca__parse_size(const char *text, size_t len, uint64_t *out) {
  size_t i = 0;
  while (i < len && isspace((unsigned char)text[i])) i++;
  uint64_t whole = 0;
  size_t digits = gca__parse_decimal(text + i, len - i, &whole);
  if (!digits) return false; /* none, or past 64 bits */
  i += digits;
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

void gca__format_bytes(uint64_t bytes, char *buf, size_t cap) {
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

/* ---- JSON strings from any bytes ------------------------------------------ */

size_t gca__utf8_length(const unsigned char *s) {
  unsigned c = s[0];
  if (c < 0x80) return 1;
  size_t n;
  unsigned lo = 0x80, hi = 0xbf; /* the second byte's range (overlong forms and surrogates excluded) */
  if (c >= 0xc2 && c <= 0xdf) n = 2;
  else if (c == 0xe0) n = 3, lo = 0xa0;
  else if (c == 0xed) n = 3, hi = 0x9f;
  else if (c >= 0xe1 && c <= 0xef) n = 3;
  else if (c == 0xf0) n = 4, lo = 0x90;
  else if (c == 0xf4) n = 4, hi = 0x8f;
  else if (c >= 0xf1 && c <= 0xf3) n = 4;
  else return 0;
  if (s[1] < lo || s[1] > hi) return 0;
  for (size_t i = 2; i < n; i++)
    if (s[i] < 0x80 || s[i] > 0xbf) return 0;
  return n;
}

void gca__json_string(FILE *f, const char *text) {
  const unsigned char *s = (const unsigned char *)(text ? text : "");
  fputc('"', f);
  while (*s) {
    unsigned c = *s;
    size_t n = gca__utf8_length(s);
    if (n == 0) {
      fprintf(f, "\\udc%02x", c);
      s++;
    } else if (n > 1) {
      fwrite(s, 1, n, f);
      s += n;
    } else {
      if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
      else if (c < 0x20 || c == 0x7f || c == '<' || c == '>' || c == '&') fprintf(f, "\\u%04x", c);
      else fputc((int)c, f);
      s++;
    }
  }
  fputc('"', f);
}
