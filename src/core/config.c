/* The allocator configuration string, in PyTorch's PYTORCH_CUDA_ALLOC_CONF
 * syntax: "key:value,key:value", list values in brackets
 * ("roundup_power2_divisions:[256:1,512:2,>:8]"), booleans True/False,
 * spaces ignored.
 *
 * Parsing is all-or-nothing: the text is applied to a copy and the copy is
 * kept only if every entry was valid, so a bad string never leaves half its
 * keys in force. Keys the string does not name keep their values (PyTorch
 * resets them to defaults on every parse, which makes two partial strings
 * impossible to combine). Warnings (unknown keys, features not built yet) are
 * gathered while parsing and logged only once the whole string is accepted.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"

void gca__config_defaults(config_t *cfg) {
  memset(cfg, 0, sizeof *cfg);
  cfg->max_split_size = SIZE_MAX;
  cfg->max_non_split_rounding = LARGE_BUFFER;
  cfg->gc_threshold = 0.0;
  cfg->memory_fraction = 1.0;
  cfg->oom_handler_retries = 3;
  cfg->pinned_num_register_threads = 1;
  cfg->ipc_release_timeout_ms = 1000;
  cfg->base_addr_aligned_kb = -1;
}

/* ---- tokens ------------------------------------------------------------- */

typedef struct token {
  const char *text;
  size_t len;
} token_t;

typedef struct parser {
  token_t *tokens;
  size_t count;
  size_t pos;
  const char *origin;
  config_t *cfg;
  char warnings[8][256];
  size_t warning_count;
} parser_t;

static bool is_punct(char c) { return c == ',' || c == ':' || c == '[' || c == ']'; }

/* Split on , : [ ] (each its own token), dropping spaces, as PyTorch's lexer. */
static size_t tokenize(char *buf, const char *text, token_t *tokens) {
  size_t n = 0, w = 0;
  const char *word = NULL;
  for (const char *p = text;; p++) {
    char c = *p;
    if (c == '\0' || is_punct(c)) {
      if (word) {
        tokens[n].text = word;
        tokens[n].len = (size_t)(buf + w - word);
        n++;
        buf[w++] = '\0';
        word = NULL;
      }
      if (c == '\0') break;
      tokens[n].text = buf + w;
      tokens[n].len = 1;
      n++;
      buf[w++] = c;
      buf[w++] = '\0';
    } else if (c != ' ' && c != '\t' && c != '\n' && c != '\r') {
      if (!word) word = buf + w;
      buf[w++] = c;
    }
  }
  return n;
}

static bool tok_is(const token_t *t, const char *s) {
  return t && t->len == strlen(s) && memcmp(t->text, s, t->len) == 0;
}

static token_t *peek(parser_t *p) { return p->pos < p->count ? &p->tokens[p->pos] : NULL; }

static token_t *next(parser_t *p) { return p->pos < p->count ? &p->tokens[p->pos++] : NULL; }

static const char *where(const parser_t *p) { return p->origin ? p->origin : "allocator configuration"; }

static int fail(parser_t *p, const char *key, const token_t *value, const char *rule) {
  if (value)
    return gca__set_error(GCA_ERR_CONFIG, "%s: invalid value '%.*s' for %s: %s", where(p), (int)value->len,
                          value->text, key, rule);
  return gca__set_error(GCA_ERR_CONFIG, "%s: missing value for %s: %s", where(p), key, rule);
}

static void warn(parser_t *p, const char *fmt, ...) GCA_PRINTF(2, 3);
static void warn(parser_t *p, const char *fmt, ...) {
  if (p->warning_count < sizeof p->warnings / sizeof p->warnings[0]) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->warnings[p->warning_count++], sizeof p->warnings[0], fmt, ap);
    va_end(ap);
  }
}

static void warn_not_built(parser_t *p, const char *key) {
  warn(p, "configuration key '%s' is accepted but its feature is not built yet; it has no effect", key);
}

/* ---- values ------------------------------------------------------------- */

static bool parse_uint(const token_t *t, uint64_t *out) {
  if (!t || t->len == 0 || t->len > 20) return false;
  uint64_t v = 0;
  if (gca__parse_decimal(t->text, t->len, &v) != t->len) return false;
  *out = v;
  return true;
}

static bool parse_double(const token_t *t, double *out) {
  if (!t || t->len == 0 || t->len > 64 || is_punct(t->text[0])) return false;
  char tmp[65];
  memcpy(tmp, t->text, t->len);
  tmp[t->len] = '\0';
  char *end;
  errno = 0;
  double v = strtod(tmp, &end);
  if (*end != '\0' || errno != 0 || !isfinite(v)) return false;
  *out = v;
  return true;
}

static bool is_pow2(uint64_t v) { return v && (v & (v - 1)) == 0; }

/* Consume ':' after a key; every key takes a value. */
static int expect_colon(parser_t *p, const char *key) {
  token_t *t = next(p);
  if (!tok_is(t, ":")) return fail(p, key, t, "expected ':' after the key");
  return GCA_OK;
}

/* An integer value in [0, max], or a failure quoting `rule`. */
static int read_uint_upto(parser_t *p, const char *key, uint64_t max, const char *rule, uint64_t *out) {
  token_t *v = next(p);
  *out = 0; /* defined even on failure: gcc -O3 cannot see that callers read it only on success */
  if (!parse_uint(v, out) || *out > max) return fail(p, key, v, rule);
  return GCA_OK;
}

static int read_bool(parser_t *p, const char *key, bool *out) {
  token_t *v = next(p);
  if (tok_is(v, "True")) *out = true;
  else if (tok_is(v, "False")) *out = false;
  else return fail(p, key, v, "expected True or False");
  return GCA_OK;
}

static int read_mb_at_least_20(parser_t *p, const char *key, size_t *out) {
  token_t *v = next(p);
  uint64_t mb;
  if (!parse_uint(v, &mb) || mb < LARGE_BUFFER / MIB)
    return fail(p, key, v, "must be an integer number of MiB >= 20");
  if (mb > SIZE_MAX / MIB) mb = SIZE_MAX / MIB; /* PyTorch clamps the same way */
  *out = (size_t)mb * MIB;
  return GCA_OK;
}

/* More divisions than a 64-bit size has 512-byte steps mean nothing, and
 * 512 times the count would wrap. */
#define DIVISIONS_MAX ((uint64_t)1 << 54)

static int read_divisions(parser_t *p, const char *key) {
  size_t *div = p->cfg->roundup_divisions;
  token_t *v = next(p);
  if (!tok_is(v, "[")) {
    uint64_t d;
    if (!parse_uint(v, &d) || !is_pow2(d))
      return fail(p, key, v, "must be a power of two, or a list like [256:1,512:2,>:8]");
    if (d > DIVISIONS_MAX) return fail(p, key, v, "must be at most 2^54");
    for (int i = 0; i < ROUNDUP_INTERVALS; i++) div[i] = (size_t)d;
    return GCA_OK;
  }
  bool first = true;
  int last_index = -1;
  for (;;) {
    token_t *k = next(p);
    if (!k) return fail(p, key, NULL, "the list is missing its closing ']'");
    if (tok_is(k, "]")) break;
    if (!tok_is(next(p), ":")) return fail(p, key, k, "list entries are SIZE_MB:DIVISIONS or >:DIVISIONS");
    token_t *val = next(p);
    uint64_t d;
    if (!parse_uint(val, &d) || (d != 0 && !is_pow2(d)))
      return fail(p, key, val, "divisions must be 0 or a power of two");
    if (d > DIVISIONS_MAX) return fail(p, key, val, "divisions must be at most 2^54");
    if (tok_is(k, ">")) {
      /* PyTorch fills from the last named interval itself, overwriting it;
       * we fill only the intervals after it, as ">" says. */
      for (int i = last_index + 1; i < ROUNDUP_INTERVALS; i++) div[i] = (size_t)d;
    } else {
      uint64_t mb;
      if (!parse_uint(k, &mb) || !is_pow2(mb))
        return fail(p, key, k, "interval sizes must be powers of two (in MiB) or '>'");
      int index = 63 - __builtin_clzll(mb);
      if (index > ROUNDUP_INTERVALS - 1) index = ROUNDUP_INTERVALS - 1;
      if (first) {
        /* The first interval named also covers every smaller one. */
        for (int i = 0; i < index; i++) div[i] = (size_t)d;
        first = false;
      }
      div[index] = (size_t)d;
      last_index = index;
    }
    token_t *sep = peek(p);
    if (!sep) return fail(p, key, NULL, "the list is missing its closing ']'");
    if (tok_is(sep, ",")) p->pos++;
    else if (!tok_is(sep, "]")) return fail(p, key, sep, "expected ',' or ']' in the list");
  }
  return GCA_OK;
}

/* ---- keys --------------------------------------------------------------- */

static int parse_entry(parser_t *p, const token_t *keytok) {
  char key[64];
  snprintf(key, sizeof key, "%.*s", (int)(keytok->len < 63 ? keytok->len : 63), keytok->text);
  config_t *c = p->cfg;
  int rc = expect_colon(p, key);
  if (rc) return rc;

  if (strcmp(key, "max_split_size_mb") == 0) return read_mb_at_least_20(p, key, &c->max_split_size);
  if (strcmp(key, "max_non_split_rounding_mb") == 0)
    return read_mb_at_least_20(p, key, &c->max_non_split_rounding);
  if (strcmp(key, "roundup_power2_divisions") == 0) return read_divisions(p, key);
  if (strcmp(key, "garbage_collection_threshold") == 0) {
    token_t *v = next(p);
    double t;
    if (!parse_double(v, &t) || !(t > 0.0 && t < 1.0))
      return fail(p, key, v, "must be a number in (0.0, 1.0)");
    c->gc_threshold = t;
    return GCA_OK;
  }
  if (strcmp(key, "per_process_memory_fraction") == 0) {
    token_t *v = next(p);
    double f;
    if (!parse_double(v, &f) || !(f >= 0.0 && f <= 1.0))
      return fail(p, key, v, "must be a number in [0.0, 1.0]");
    c->memory_fraction = f;
    c->memory_fraction_set = true;
    return GCA_OK;
  }
  if (strcmp(key, "oom_retry_timeout_ms") == 0) {
    /* gcalloc's own: how long an allocation may wait for memory to come back. */
    return read_uint_upto(p, key, 3600000, "must be milliseconds from 0 to 3600000", &c->oom_retry_timeout_ms);
  }
  if (strcmp(key, "oom_handler_retries") == 0) {
    /* gcalloc's own: how many times OOM handlers may ask for another try. */
    uint64_t n;
    rc = read_uint_upto(p, key, 100, "must be an integer from 0 to 100", &n);
    if (rc == GCA_OK) c->oom_handler_retries = (uint32_t)n;
    return rc;
  }
  if (strcmp(key, "expandable_segments") == 0) {
    c->expandable_segments_set = true;
    return read_bool(p, key, &c->expandable_segments);
  }
  if (strcmp(key, "stitching") == 0) {
    /* gcalloc's own: with expandable segments, move free pages into place before mapping new ones. */
    return read_bool(p, key, &c->stitching);
  }
  if (strcmp(key, "cross_stream_reuse") == 0) {
    /* gcalloc's own: True, False, or the largest segment (as a multiple of
     * the one the device would be asked for) that may move between streams. */
    token_t *v = next(p);
    double ratio;
    if (tok_is(v, "True")) c->cross_stream_reuse = HUGE_VAL;
    else if (tok_is(v, "False")) c->cross_stream_reuse = 0;
    else if (parse_double(v, &ratio) && ratio >= 1.0 && ratio <= 1e6) c->cross_stream_reuse = ratio;
    else return fail(p, key, v, "must be True, False or a size ratio >= 1");
    return GCA_OK;
  }
  if (strcmp(key, "ipc_cooperation") == 0) return read_bool(p, key, &c->ipc_cooperation);
  if (strcmp(key, "ipc_group_access") == 0) return read_bool(p, key, &c->ipc_group_access);
  if (strcmp(key, "ipc_release_timeout_ms") == 0)
    return read_uint_upto(p, key, 600000, "must be milliseconds from 0 to 600000", &c->ipc_release_timeout_ms);
  if (strcmp(key, "pad_32_bytes") == 0) {
    /* gcalloc's own: torch_npu's 32-byte pad before rounding; auto asks the backend (the SoC). */
    token_t *v = next(p);
    if (tok_is(v, "auto")) c->pad_32_mode = PAD_AUTO;
    else if (tok_is(v, "True")) c->pad_32_mode = PAD_ON;
    else if (tok_is(v, "False")) c->pad_32_mode = PAD_OFF;
    else return fail(p, key, v, "must be auto, True or False");
    return GCA_OK;
  }
  /* torch_npu's keys (PYTORCH_NPU_ALLOC_CONF): its names for keys gcalloc
   * has, then those whose feature is not built, checked and warned of. */
  if (strcmp(key, "pinned_mem_register") == 0) return read_bool(p, key, &c->pinned_use_host_register);
  if (strcmp(key, "throw_on_cudamalloc_oom") == 0 || strcmp(key, "throw_on_npumalloc_oom") == 0 ||
      strcmp(key, "throw_on_hipmalloc_oom") == 0)
    return read_bool(p, key, &c->throw_on_malloc_oom);
  if (strcmp(key, "multi_stream_lazy_reclaim") == 0 || strcmp(key, "pin_memory_expandable_segments") == 0) {
    bool on;
    rc = read_bool(p, key, &on);
    if (rc == GCA_OK && on) warn_not_built(p, key);
    return rc;
  }
  if (strcmp(key, "base_addr_aligned_kb") == 0) {
    uint64_t kb;
    rc = read_uint_upto(p, key, 16, "must be an integer from 0 to 16 (KiB)", &kb);
    if (rc == GCA_OK) c->base_addr_aligned_kb = (int)kb;
    return rc;
  }
  if (strcmp(key, "segment_size_mb") == 0 || strcmp(key, "large_segment_size_mb") == 0) {
    token_t *v = next(p);
    uint64_t mb;
    if (!parse_uint(v, &mb) || mb < 20 || mb > 512) return fail(p, key, v, "must be an integer from 20 to 512 (MiB)");
    if (mb != 20) warn_not_built(p, key);
    return GCA_OK;
  }
  if (strcmp(key, "page_size") == 0) {
    token_t *v = next(p);
    if (tok_is(v, "1g")) warn_not_built(p, "page_size:1g");
    else if (!tok_is(v, "default")) return fail(p, key, v, "must be 1g or default");
    return GCA_OK;
  }
  if (strcmp(key, "release_lock_on_cudamalloc") == 0 || strcmp(key, "release_lock_on_hipmalloc") == 0 ||
      strcmp(key, "release_lock_on_npumalloc") == 0) {
    rc = read_bool(p, key, &c->release_lock_on_malloc);
    if (rc == GCA_OK && c->release_lock_on_malloc) warn_not_built(p, key);
    return rc;
  }
  if (strcmp(key, "pinned_use_cuda_host_register") == 0 || strcmp(key, "pinned_use_hip_host_register") == 0) {
    return read_bool(p, key, &c->pinned_use_host_register);
  }
  if (strcmp(key, "pinned_use_background_threads") == 0) {
    return read_bool(p, key, &c->pinned_use_background_threads);
  }
  if (strcmp(key, "pinned_num_register_threads") == 0) {
    token_t *v = next(p);
    uint64_t n;
    if (!parse_uint(v, &n) || !is_pow2(n) || n > 128)
      return fail(p, key, v, "must be a power of two <= 128");
    c->pinned_num_register_threads = (size_t)n;
    return GCA_OK;
  }
  if (strcmp(key, "backend") == 0) {
    token_t *v = next(p);
    if (tok_is(v, "native")) {
      c->backend_async = false;
    } else if (tok_is(v, "cudaMallocAsync") || tok_is(v, "hipMallocAsync")) {
      c->backend_async = true;
      warn(p, "configuration key '%s:cudaMallocAsync' is accepted but not built yet; the native caching "
              "allocator is used", key);
    } else {
      return fail(p, key, v, "must be native or cudaMallocAsync");
    }
    return GCA_OK;
  }
  if (strcmp(key, "pinned_reserve_segment_size_mb") == 0) {
    token_t *v = next(p);
    uint64_t n;
    /* (The bound keeps n MiB a size_t with room to spare.) */
    if (!parse_uint(v, &n) || n == 0 || n > ((uint64_t)1 << 30))
      return fail(p, key, v, "must be an integer > 0 and at most 2^30");
    c->pinned_reserve_segment_mb = (size_t)n;
    return GCA_OK;
  }
  /* Keys of newer PyTorch versions that gcalloc knows but does not build. */
  if (strcmp(key, "graph_capture_record_stream_reuse") == 0) {
    bool ignored;
    rc = read_bool(p, key, &ignored);
    if (rc == GCA_OK) warn_not_built(p, key);
    return rc;
  }

  /* Unknown: skip its value (a word or a bracket list) and warn. */
  token_t *v = next(p);
  if (!v || is_punct(v->text[0])) {
    if (!tok_is(v, "[")) return fail(p, key, v, "expected a value");
    int depth = 1;
    while (depth > 0) {
      token_t *t = next(p);
      if (!t) return fail(p, key, NULL, "the list is missing its closing ']'");
      if (tok_is(t, "[")) depth++;
      if (tok_is(t, "]")) depth--;
    }
  }
  warn(p, "unrecognized configuration key '%s' ignored", key);
  return GCA_OK;
}

int gca__config_apply(config_t *cfg, const char *text, const char *origin) {
  if (!text || !*text) return GCA_OK;
  size_t n = strlen(text);
  /* Worst case every character is a one-character token with its NUL. */
  char *buf = malloc(2 * n + 2);
  token_t *tokens = malloc((n + 1) * sizeof *tokens);
  parser_t *p = calloc(1, sizeof *p);
  if (!buf || !tokens || !p) {
    free(buf);
    free(tokens);
    free(p);
    return gca__set_error(GCA_ERR_NOMEM, "out of host memory parsing the allocator configuration");
  }
  config_t work = *cfg;
  p->tokens = tokens;
  p->count = tokenize(buf, text, tokens);
  p->origin = origin;
  p->cfg = &work;

  int rc = GCA_OK;
  while (rc == GCA_OK && p->pos < p->count) {
    token_t *t = next(p);
    if (tok_is(t, ",")) continue; /* tolerate empty entries */
    if (is_punct(t->text[0])) {
      rc = gca__set_error(GCA_ERR_CONFIG, "%s: expected a key, found '%.*s'", where(p), (int)t->len, t->text);
      break;
    }
    rc = parse_entry(p, t);
    if (rc == GCA_OK && p->pos < p->count && !tok_is(peek(p), ",")) {
      token_t *extra = peek(p);
      rc = gca__set_error(GCA_ERR_CONFIG, "%s: expected ',' after the value of '%.*s', found '%.*s'", where(p),
                          (int)t->len, t->text, (int)extra->len, extra->text);
    }
  }
  if (rc == GCA_OK) {
    if (!work.expandable_segments_set) work.expandable_segments = work.ipc_cooperation;
    work.page_rounding = work.ipc_cooperation && work.expandable_segments;
    work.any_divisions = work.page_rounding;
    for (int i = 0; i < ROUNDUP_INTERVALS; i++) work.any_divisions |= work.roundup_divisions[i] > 1;
    if (work.stitching && !work.expandable_segments)
      warn(p, "stitching:True has an effect only with expandable_segments:True");
    *cfg = work;
    for (size_t i = 0; i < p->warning_count; i++) gca__log_message(GCA_LOG_WARNING, "%s", p->warnings[i]);
  }
  free(buf);
  free(tokens);
  free(p);
  return rc;
}

/* ---- rendering ---------------------------------------------------------- */

/* ",key:value" with the shortest decimal form that reads back as the same
 * double (0.7, not 0.69999999999999996), so that the text round-trips. */
static void put_real(text_t *o, const char *key, double v) {
  char digits[40];
  for (int precision = 1; precision <= 17; precision++) {
    snprintf(digits, sizeof digits, "%.*g", precision, v);
    if (strtod(digits, NULL) == v) break;
  }
  gca__text_put(o, ",%s:%s", key, digits);
}

size_t gca__config_format(const config_t *c, char *buf, size_t cap) {
  text_t o = {buf, cap, 0};
  if (cap) buf[0] = '\0';
  gca__text_put(&o, "max_non_split_rounding_mb:%zu", c->max_non_split_rounding / MIB);
  if (c->max_split_size != SIZE_MAX) gca__text_put(&o, ",max_split_size_mb:%zu", c->max_split_size / MIB);
  bool any_division = false;
  for (int i = 0; i < ROUNDUP_INTERVALS; i++) any_division |= c->roundup_divisions[i] != 0;
  if (any_division) {
    gca__text_put(&o, ",roundup_power2_divisions:[");
    for (int i = 0; i < ROUNDUP_INTERVALS; i++)
      gca__text_put(&o, "%s%zu:%zu", i ? "," : "", (size_t)1 << i, c->roundup_divisions[i]);
    gca__text_put(&o, "]");
  }
  if (c->gc_threshold > 0) put_real(&o, "garbage_collection_threshold", c->gc_threshold);
  if (c->memory_fraction_set) put_real(&o, "per_process_memory_fraction", c->memory_fraction);
  gca__text_put(&o, ",oom_retry_timeout_ms:%llu", (unsigned long long)c->oom_retry_timeout_ms);
  gca__text_put(&o, ",oom_handler_retries:%u", (unsigned)c->oom_handler_retries);
  gca__text_put(&o, ",expandable_segments:%s", c->expandable_segments ? "True" : "False");
  gca__text_put(&o, ",stitching:%s", c->stitching ? "True" : "False");
  gca__text_put(&o, ",release_lock_on_cudamalloc:%s", c->release_lock_on_malloc ? "True" : "False");
  gca__text_put(&o, ",pinned_use_cuda_host_register:%s", c->pinned_use_host_register ? "True" : "False");
  gca__text_put(&o, ",pinned_num_register_threads:%zu", c->pinned_num_register_threads);
  gca__text_put(&o, ",pinned_use_background_threads:%s", c->pinned_use_background_threads ? "True" : "False");
  if (c->pinned_reserve_segment_mb) gca__text_put(&o, ",pinned_reserve_segment_size_mb:%zu", c->pinned_reserve_segment_mb);
  gca__text_put(&o, ",backend:%s", c->backend_async ? "cudaMallocAsync" : "native");
  if (c->pad_32_mode != PAD_AUTO) gca__text_put(&o, ",pad_32_bytes:%s", c->pad_32_mode == PAD_ON ? "True" : "False");
  if (c->base_addr_aligned_kb >= 0) gca__text_put(&o, ",base_addr_aligned_kb:%d", c->base_addr_aligned_kb);
  if (c->throw_on_malloc_oom) gca__text_put(&o, ",throw_on_cudamalloc_oom:True");
  if (c->ipc_cooperation)
    gca__text_put(&o, ",ipc_cooperation:True,ipc_release_timeout_ms:%" PRIu64 "%s", c->ipc_release_timeout_ms,
                  c->ipc_group_access ? ",ipc_group_access:True" : "");
  if (c->cross_stream_reuse == 0 || isinf(c->cross_stream_reuse))
    gca__text_put(&o, ",cross_stream_reuse:%s", c->cross_stream_reuse == 0 ? "False" : "True");
  else
    put_real(&o, "cross_stream_reuse", c->cross_stream_reuse);
  return o.len;
}
