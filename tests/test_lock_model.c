/* An exhaustive check of the biased device lock's protocol (src/base/lock.h,
 * src/base/lock.c) under x86-TSO: two threads, each taking the lock twice,
 * every interleaving of their steps and of their stores leaving the store
 * buffers, explored to the end.
 *
 * The model: each thread has a FIFO store buffer; a load reads the thread's
 * own newest buffered store to that variable, else memory; a buffered store
 * reaches memory at any moment (a step of its own); a locked instruction
 * (the futex word's compare-and-swap and exchange) waits for an empty
 * buffer and acts on memory at once. membarrier(2) is a step that drains
 * the caller's buffer and marks every other thread; a marked thread takes a
 * fence at any point of its program (a step enabled once its buffer is
 * empty), and the caller goes on only when none is marked. The lock's
 * steps are those of lock_acquire, lock_release (with gca__lock_yield) and
 * gca__lock_acquire_slow; giving the bias is a free choice at the end of
 * the slow path, and so is giving up waiting for a yield asked of the
 * owner (then revoking), so every bias decision and every timing of the
 * yield is explored.
 *
 * Checked: never two threads in the critical section; a counter each
 * critical section increments (load, then store, through the buffer) ends
 * at the number of holds (nothing written under the lock is lost or read
 * stale); no state where a thread cannot finish. And the check can fail:
 * without the membarrier it must find two threads inside.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { OWNER, HELD, LOCK, DATA, ASKED, INSIDE /* one per thread */, VARS = INSIDE + 2 };
enum { THREADS = 2, HOLDS = 2, SB_CAP = 6 };

enum pc {
  START,      /* next hold, or done */
  FAST_OWNER, /* lock_acquire: load owner (its ticket); this thread's: biased way */
  FAST_MARK,  /* store the ticket's inside = 1 */
  FAST_CHECK, /* load owner again (acquire); still this thread's: held */
  FAST_HELD,  /* store held = the ticket */
  FAST_UNDO,  /* store the ticket's inside = 0, then the futex word */
  SLOW_TAKE,  /* compare-and-swap the futex word 0 -> 1 (waits while held) */
  SLOW_OWNER, /* load owner; set: ask it to yield */
  SLOW_ASK,   /* store yield_asked = 1 */
  SLOW_ASK_WAIT, /* load owner until it changes (yielded); or, a free choice, give up and revoke */
  SLOW_CLEAR, /* store owner = NULL */
  SLOW_BARRIER, /* membarrier: drain, mark the others */
  SLOW_BARRIER_WAIT, /* until every other thread took its fence */
  SLOW_WAIT_OUT, /* load the revoked ticket's inside until 0 */
  SLOW_UNASK, /* store yield_asked = 0 */
  SLOW_BIAS,  /* free choice: store owner = this thread's ticket, or not */
  CS_ENTER, CS_LOAD, CS_STORE, CS_LEAVE,
  REL_CHECK,  /* lock_release: load held; set: a biased hold */
  REL_FAST_HELD,   /* store held = NULL */
  REL_FAST_INSIDE, /* store the ticket's inside = 0 */
  REL_FAST_ASKED,  /* load yield_asked; set: yield */
  REL_FAST_YIELD,  /* compare-and-swap owner: this thread -> NULL (waits for an empty buffer) */
  REL_SLOW,   /* exchange the futex word with 0 */
  DONE
};

typedef struct {
  uint8_t pc, reg, holds, marked, sb_len;
  uint8_t sb_var[SB_CAP], sb_val[SB_CAP];
} thread_t;

typedef struct {
  thread_t t[THREADS];
  uint8_t mem[VARS];
  uint8_t in_cs;
} state_t;

static bool with_barrier;
static size_t states_seen, violations_found;
static const char *first_violation;

/* ---- the visited set (open addressing on the whole state) ---- */
static state_t *table;
static uint8_t *used;
static size_t table_cap;
static state_t *nodes;      /* every state once, in the order found */
static size_t *parents, node_cap;

static uint64_t hash_state(const state_t *s) {
  const unsigned char *p = (const unsigned char *)s;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < sizeof *s; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

static bool visit(const state_t *s) { /* true: new */
  if (states_seen * 2 >= table_cap) {
    size_t old_cap = table_cap;
    state_t *old = table;
    uint8_t *old_used = used;
    table_cap = table_cap ? table_cap * 2 : 1 << 16;
    table = calloc(table_cap, sizeof *table);
    used = calloc(table_cap, 1);
    if (!table || !used) {
      fprintf(stderr, "out of memory\n");
      exit(2);
    }
    for (size_t i = 0; i < old_cap; i++) {
      if (!old_used[i]) continue;
      size_t j = hash_state(&old[i]) & (table_cap - 1);
      while (used[j]) j = (j + 1) & (table_cap - 1);
      table[j] = old[i];
      used[j] = 1;
    }
    free(old);
    free(old_used);
  }
  size_t j = hash_state(s) & (table_cap - 1);
  while (used[j]) {
    if (memcmp(&table[j], s, sizeof *s) == 0) return false;
    j = (j + 1) & (table_cap - 1);
  }
  table[j] = *s;
  used[j] = 1;
  states_seen++;
  return true;
}

/* ---- memory under TSO ---- */
static uint8_t load(const state_t *s, int i, int var) {
  const thread_t *t = &s->t[i];
  for (int k = t->sb_len - 1; k >= 0; k--)
    if (t->sb_var[k] == var) return t->sb_val[k];
  return s->mem[var];
}

static bool store(state_t *s, int i, int var, uint8_t val) { /* false: buffer full, not enabled */
  thread_t *t = &s->t[i];
  if (t->sb_len == SB_CAP) return false;
  t->sb_var[t->sb_len] = (uint8_t)var;
  t->sb_val[t->sb_len++] = val;
  return true;
}

static void flush_one(state_t *s, int i) {
  thread_t *t = &s->t[i];
  s->mem[t->sb_var[0]] = t->sb_val[0];
  memmove(t->sb_var, t->sb_var + 1, --t->sb_len);
  memmove(t->sb_val, t->sb_val + 1, t->sb_len);
  t->sb_var[t->sb_len] = t->sb_val[t->sb_len] = 0; /* (one state, one encoding) */
}

static void violation(const char *what) {
  if (!violations_found++) first_violation = what;
}

/* One program step of thread i (its id is i + 1); false when not enabled.
 * `choice` picks the branch of the free choice (SLOW_BIAS). */
static bool step(state_t *s, int i, int choice) {
  thread_t *t = &s->t[i];
  uint8_t self = (uint8_t)(i + 1);
  bool empty = t->sb_len == 0;
  if (choice && t->pc != SLOW_BIAS && t->pc != SLOW_ASK_WAIT) return false;
  switch (t->pc) {
  case START: t->pc = t->holds == HOLDS ? DONE : FAST_OWNER; return true;
  case FAST_OWNER: t->pc = load(s, i, OWNER) == self ? FAST_MARK : SLOW_TAKE; return true;
  case FAST_MARK: if (!store(s, i, INSIDE + i, 1)) return false; t->pc = FAST_CHECK; return true;
  case FAST_CHECK: t->pc = load(s, i, OWNER) == self ? FAST_HELD : FAST_UNDO; return true;
  case FAST_HELD: if (!store(s, i, HELD, self)) return false; t->pc = CS_ENTER; return true;
  case FAST_UNDO: if (!store(s, i, INSIDE + i, 0)) return false; t->pc = SLOW_TAKE; return true;
  case SLOW_TAKE:
    if (!empty || s->mem[LOCK] != 0) return false;
    s->mem[LOCK] = 1;
    t->pc = SLOW_OWNER;
    return true;
  case SLOW_OWNER:
    t->reg = load(s, i, OWNER);
    if (t->reg == self) violation("the slow path found the lock biased to its own thread");
    t->pc = t->reg ? SLOW_ASK : SLOW_BIAS;
    return true;
  case SLOW_ASK: if (!store(s, i, ASKED, 1)) return false; t->pc = SLOW_ASK_WAIT; return true;
  case SLOW_ASK_WAIT:
    if (choice) { /* no yield came: revoke */
      t->pc = SLOW_CLEAR;
      return true;
    }
    if (load(s, i, OWNER) == t->reg) return false; /* (spinning: no new state) */
    t->pc = SLOW_UNASK;
    return true;
  case SLOW_CLEAR: if (!store(s, i, OWNER, 0)) return false; t->pc = SLOW_BARRIER; return true;
  case SLOW_BARRIER:
    if (!with_barrier) {
      t->pc = SLOW_WAIT_OUT;
      return true;
    }
    if (!empty) return false;
    for (int k = 0; k < THREADS; k++)
      if (k != i) s->t[k].marked = 1;
    t->pc = SLOW_BARRIER_WAIT;
    return true;
  case SLOW_BARRIER_WAIT:
    for (int k = 0; k < THREADS; k++)
      if (k != i && s->t[k].marked) return false;
    t->pc = SLOW_WAIT_OUT;
    return true;
  case SLOW_WAIT_OUT:
    if (load(s, i, INSIDE + t->reg - 1) != 0) return false;
    t->pc = SLOW_UNASK;
    return true;
  case SLOW_UNASK: if (!store(s, i, ASKED, 0)) return false; t->pc = SLOW_BIAS; return true;
  case SLOW_BIAS:
    if (choice && !store(s, i, OWNER, self)) return false;
    t->reg = 0;
    t->pc = CS_ENTER;
    return true;
  case CS_ENTER:
    if (s->in_cs) violation("two threads in the critical section");
    s->in_cs = 1;
    t->pc = CS_LOAD;
    return true;
  case CS_LOAD: t->reg = load(s, i, DATA); t->pc = CS_STORE; return true;
  case CS_STORE: if (!store(s, i, DATA, (uint8_t)(t->reg + 1))) return false; t->pc = CS_LEAVE; return true;
  case CS_LEAVE: s->in_cs = 0; t->reg = 0; t->pc = REL_CHECK; return true;
  case REL_CHECK: {
    uint8_t held = load(s, i, HELD);
    if (held && held != self) violation("a hold found another thread's biased hold");
    t->pc = held ? REL_FAST_HELD : REL_SLOW;
    return true;
  }
  case REL_FAST_HELD: if (!store(s, i, HELD, 0)) return false; t->pc = REL_FAST_INSIDE; return true;
  case REL_FAST_INSIDE: if (!store(s, i, INSIDE + i, 0)) return false; t->pc = REL_FAST_ASKED; return true;
  case REL_FAST_ASKED:
    if (load(s, i, ASKED)) {
      t->pc = REL_FAST_YIELD;
      return true;
    }
    t->holds++;
    t->pc = START;
    return true;
  case REL_FAST_YIELD:
    if (!empty) return false;
    if (s->mem[OWNER] == self) s->mem[OWNER] = 0;
    t->holds++;
    t->pc = START;
    return true;
  case REL_SLOW:
    if (!empty) return false;
    s->mem[LOCK] = 0;
    t->holds++;
    t->pc = START;
    return true;
  case DONE: return false;
  }
  return false;
}

static const char *pc_names[] = {
    "START",      "FAST_OWNER", "FAST_MARK",    "FAST_CHECK",        "FAST_HELD",     "FAST_UNDO",
    "SLOW_TAKE",  "SLOW_OWNER", "SLOW_ASK",     "SLOW_ASK_WAIT",     "SLOW_CLEAR",    "SLOW_BARRIER",
    "SLOW_BARRIER_WAIT", "SLOW_WAIT_OUT", "SLOW_UNASK", "SLOW_BIAS", "CS_ENTER",   "CS_LOAD",
    "CS_STORE",   "CS_LEAVE",   "REL_CHECK",    "REL_FAST_HELD",     "REL_FAST_INSIDE", "REL_FAST_ASKED",
    "REL_FAST_YIELD", "REL_SLOW", "DONE"};

static void print_state(const state_t *s) {
  printf("  owner=%d held=%d lock=%d data=%d asked=%d inside=%d,%d |", s->mem[OWNER], s->mem[HELD],
         s->mem[LOCK], s->mem[DATA], s->mem[ASKED], s->mem[INSIDE], s->mem[INSIDE + 1]);
  for (int i = 0; i < THREADS; i++) {
    const thread_t *t = &s->t[i];
    printf(" t%d %s%s buffer[", i + 1, pc_names[t->pc], t->marked ? " (fence due)" : "");
    for (int k = 0; k < t->sb_len; k++)
      printf("%s%s=%d", k ? " " : "", (const char *[]){"owner", "held", "lock", "data", "asked", "inside1", "inside2"}[t->sb_var[k]], t->sb_val[k]);
    printf("]");
  }
  printf("\n");
}

/* The way to the first violation, from the initial state. */
static void print_path(size_t node) {
  size_t len = 0, *path = malloc((states_seen + 1) * sizeof *path);
  if (!path) return;
  for (size_t n = node; n != SIZE_MAX; n = parents[n]) path[len++] = n;
  while (len) print_state(&nodes[path[--len]]);
  free(path);
}

static size_t add_node(const state_t *s, size_t parent) {
  if (!visit(s)) return SIZE_MAX;
  if (states_seen > node_cap) {
    node_cap = node_cap ? node_cap * 2 : 1 << 16;
    nodes = realloc(nodes, node_cap * sizeof *nodes);
    parents = realloc(parents, node_cap * sizeof *parents);
    if (!nodes || !parents) exit(2);
  }
  nodes[states_seen - 1] = *s;
  parents[states_seen - 1] = parent;
  return states_seen - 1;
}

/* Breadth-first over all successors; the first violation's path printed. */
static void explore(const state_t *initial) {
  add_node(initial, SIZE_MAX);
  for (size_t at = 0; at < states_seen; at++) {
    state_t s = nodes[at];
    size_t before = violations_found;
    bool any = false, finished = true;
    for (int i = 0; i < THREADS; i++) {
      const thread_t *t = &s.t[i];
      if (t->pc != DONE || t->sb_len) finished = false;
      /* successors: a program step (and the other branch of the choice), a
       * store leaving the buffer, the fence a membarrier asked for */
      for (int kind = 0; kind < 4; kind++) {
        state_t n = s;
        bool ok;
        if (kind == 0) ok = step(&n, i, 0);
        else if (kind == 1) ok = step(&n, i, 1);
        else if (kind == 2) ok = n.t[i].sb_len > 0 && (flush_one(&n, i), true);
        else if ((ok = n.t[i].marked && n.t[i].sb_len == 0)) n.t[i].marked = 0;
        if (!ok) continue;
        any = true;
        add_node(&n, at);
      }
    }
    if (finished) {
      if (s.mem[DATA] != THREADS * HOLDS) violation("an update made under the lock was lost");
    } else if (!any) {
      violation("a thread can never finish");
    }
    if (before == 0 && violations_found && with_barrier) print_path(at);
  }
}

static size_t run(bool barrier, uint8_t initial_owner) {
  with_barrier = barrier;
  violations_found = states_seen = 0;
  first_violation = NULL;
  free(table);
  free(used);
  table = NULL;
  used = NULL;
  table_cap = 0;
  state_t s;
  memset(&s, 0, sizeof s);
  s.mem[OWNER] = initial_owner;
  explore(&s);
  printf("%s membarrier, first biased to %s: %zu states, %zu violations%s%s\n", barrier ? "with" : "without",
         initial_owner ? "thread 1" : "nobody", states_seen, violations_found, first_violation ? ": first: " : "",
         first_violation ? first_violation : "");
  return violations_found;
}

int main(void) {
  int failed = 0;
  for (uint8_t owner = 0; owner <= 1; owner++) {
    if (run(true, owner) != 0) failed = 1;
    /* The check must be able to fail: the same protocol without the
     * barrier lets the owner's store to `inside` sit in its buffer while
     * the revoker reads NULL. */
    if (run(false, owner) == 0) {
      printf("the check found nothing wrong without the membarrier: it proves nothing\n");
      failed = 1;
    }
  }
  free(table);
  free(used);
  free(nodes);
  free(parents);
  printf("%s\n", failed ? "FAILED" : "OK");
  return failed;
}
