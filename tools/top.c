/* `gcalloc top [--json] [--interval SECONDS]`: the processes cooperating on
 * each device of this host (ipc_cooperation:True, docs/sharing.md),
 * with what each reserves, allocates, caches and waits for and its requests
 * so far, and the device's total and free memory and what processes that do
 * not cooperate hold, as the members last published it (gca_ipc_scan). On a terminal it refreshes until
 * interrupted; otherwise, and with --json, it prints once.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "base/base.h"
#include "gcalloc.h"
#include "tool.h"

#define MAX_DEVICES 64

static double mib(uint64_t bytes) { return (double)bytes / (1024.0 * 1024.0); }

/* What a region says is what its processes wrote (a process of this user
 * that misbehaves, or memory gone wrong): figures no allocator can publish
 * are marked, not shown as facts. NULL when plausible. */
#define PIB ((uint64_t)1 << 50)
/* A process silent this long has stopped answering (it publishes every 100 ms). */
#define STOPPED_MS 1000

static const char *implausible_device(const gca_ipc_device_t *d) {
  if (d->free_bytes > d->total_bytes) return "free_bytes > total_bytes";
  if (d->total_bytes > PIB) return "total_bytes > 1 PiB";
  return NULL;
}

static const char *implausible_peer(const gca_ipc_device_t *d, const gca_ipc_peer_t *p) {
  if (p->pid <= 0) return "pid <= 0";
  if (p->allocated_bytes > p->reserved_bytes) return "allocated_bytes > reserved_bytes";
  if (p->cached_bytes > p->reserved_bytes) return "cached_bytes > reserved_bytes";
  /* Memory held: at most the device (1 PiB when its total is not known);
   * bytes moved over a life: at most 1 EiB. */
  uint64_t held = d->total_bytes && !implausible_device(d) ? d->total_bytes : PIB;
  const char *held_name = held == PIB ? "1 PiB" : "the device's total";
  const struct {
    const char *name;
    uint64_t value, most;
    const char *most_name;
  } figures[] = {{"reserved_bytes", p->reserved_bytes, held, held_name},
                 {"waiting_bytes", p->waiting_bytes, held, held_name},
                 {"paused_bytes", p->paused_bytes, held, held_name},
                 {"bytes_received", p->bytes_received, PIB * 1024, "1 EiB"},
                 {"bytes_released", p->bytes_released, PIB * 1024, "1 EiB"}};
  static char why[64];
  for (size_t i = 0; i < sizeof figures / sizeof figures[0]; i++)
    if (figures[i].value > figures[i].most) {
      snprintf(why, sizeof why, "%s > %s", figures[i].name, figures[i].most_name);
      return why;
    }
  return NULL;
}

/* An identity on a terminal: printable ASCII as it is, any other byte (an
 * escape sequence another process wrote, a byte that is not UTF-8) as
 * \xNN, and a backslash doubled. */
static void print_escaped(const char *s) {
  for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
    if (*c == '\\') fputs("\\\\", stdout);
    else if (*c >= 0x20 && *c < 0x7f) putchar(*c);
    else printf("\\x%02x", *c);
  }
}

static void json_reason(const char *why) {
  if (why) gca__json_string(stdout, why);
  else fputs("null", stdout);
}

static void print_json(const gca_ipc_device_t *d, int n, int skipped) {
  printf("{\"skipped_regions\": %d, \"devices\": [", skipped);
  for (int i = 0; i < n; i++) {
    printf("%s\n  {\"identity\": ", i ? "," : "");
    gca__json_string(stdout, d[i].identity);
    printf(", \"total_bytes\": %" PRIu64 ", \"free_bytes\": %" PRIu64 ", \"other_bytes\": ", d[i].total_bytes,
           d[i].free_bytes);
    if (d[i].settled) printf("%" PRIu64, d[i].other_bytes);
    else printf("null"); /* (not known: the members' memory kept changing while it was read) */
    printf(", \"implausible\": ");
    json_reason(implausible_device(&d[i]));
    printf(", \"processes\": [");
    for (int k = 0; k < d[i].peer_count; k++) {
      const gca_ipc_peer_t *p = &d[i].peers[k];
      printf("%s{\"pid\": %d, \"reserved_bytes\": %" PRIu64 ", \"allocated_bytes\": %" PRIu64
             ", \"cached_bytes\": %" PRIu64 ", \"waiting_bytes\": %" PRIu64 ", \"paused_bytes\": %" PRIu64
             ", \"requests\": %" PRIu64 ", \"bytes_received\": %" PRIu64 ", \"bytes_released\": %" PRIu64
             ", \"timeouts\": %" PRIu64 ", \"avoidable_ooms\": %" PRIu64 ", \"silent_ms\": %" PRIu64
             ", \"stopped\": %s, \"implausible\": ",
             k ? ", " : "", (int)p->pid, p->reserved_bytes, p->allocated_bytes, p->cached_bytes, p->waiting_bytes,
             p->paused_bytes, p->requests, p->bytes_received, p->bytes_released, p->timeouts, p->avoidable_ooms,
             p->silent_ms, p->silent_ms > STOPPED_MS ? "true" : "false");
      json_reason(implausible_peer(&d[i], p));
      printf("}");
    }
    printf("]}");
  }
  printf("\n]}\n");
}

static void print_table(const gca_ipc_device_t *d, int n, int skipped) {
  if (n == 0) printf("no process cooperates on a device (ipc_cooperation:True) on this host\n");
  for (int i = 0; i < n; i++) {
    if (i) putchar('\n');
    print_escaped(d[i].identity);
    putchar('\n');
    const char *why = implausible_device(&d[i]);
    if (why)
      printf("  device: implausible figures (%s): not shown\n", why);
    else if (d[i].total_bytes && d[i].settled)
      printf("  device: %.1f MiB, %.1f MiB free, %.1f MiB held outside these processes\n", mib(d[i].total_bytes),
             mib(d[i].free_bytes), mib(d[i].other_bytes));
    else if (d[i].total_bytes)
      printf("  device: %.1f MiB, %.1f MiB free; held outside these processes: not known (their memory kept "
             "changing while it was read)\n", mib(d[i].total_bytes), mib(d[i].free_bytes));
    else
      printf("  device: its memory not yet known (no process here holds any)\n");
    printf("  %8s %13s %13s %13s %13s %13s %9s %13s %13s %9s %10s %9s\n", "pid", "reserved MiB", "allocated MiB",
           "cached MiB", "waiting MiB", "paused MiB", "requests", "received MiB", "released MiB", "timeouts",
           "avoidable", "seen");
    for (int k = 0; k < d[i].peer_count; k++) {
      const gca_ipc_peer_t *p = &d[i].peers[k];
      if ((why = implausible_peer(&d[i], p))) {
        printf("  %8d implausible figures (%s): not shown\n", (int)p->pid, why);
        continue;
      }
      printf("  %8d %13.1f %13.1f %13.1f %13.1f %13.1f %9" PRIu64 " %13.1f %13.1f %9" PRIu64 " %10" PRIu64
             " %7.1f s%s\n",
             (int)p->pid, mib(p->reserved_bytes), mib(p->allocated_bytes), mib(p->cached_bytes),
             mib(p->waiting_bytes), mib(p->paused_bytes), p->requests, mib(p->bytes_received),
             mib(p->bytes_released), p->timeouts, p->avoidable_ooms, (double)p->silent_ms / 1000.0,
             p->silent_ms > STOPPED_MS ? " ago: stopped answering" : " ago");
    }
  }
  if (skipped)
    printf("%s%d region%s of other users or groups skipped (not this user's to join: not read)\n", n ? "\n" : "",
           skipped, skipped == 1 ? "" : "s");
}

const tool_command_t top_command = {
    "top", NULL, "[--json] [--interval SECONDS]",
    "the processes cooperating on each device: memory, waits, requests; the device's free memory",
    "\n"
    "The processes that share a device with ipc_cooperation:True (docs/sharing.md), per device: what each\n"
    "reserves, allocates, caches (could release) and waits for, its requests to the others so far (made,\n"
    "bytes received, bytes it released for theirs, peers that did not answer, avoidable out-of-memory\n"
    "errors), and the device's total and free memory with what is held outside these processes (by\n"
    "processes that do not cooperate, or the driver), as they last published it (every 100 ms), and how\n"
    "long ago each did: one silent for over a second has stopped answering (stopped or wedged).\n"
    "Only regions this user may join are read (how many others were skipped is said); an identity is\n"
    "printed with bytes other than printable ASCII as \\xNN, and figures no allocator publishes (more\n"
    "allocated than reserved, free above total...) are marked implausible, not shown.\n"
    "On a terminal the table refreshes until interrupted; otherwise it is printed once.\n"
    "\n"
    "  --json                the devices and processes as JSON, once\n"
    "  --interval SECONDS    between refreshes on a terminal (default 1)\n"
    "  -h, --help            this help\n",
    top_main};

int top_main(int argc, char **argv) {
  bool json = false;
  long interval = 1;
  const tool_option_t options[] = {
      {"--json", OPTION_FLAG, &json, 0, 0, NULL},
      {"--interval", OPTION_NUMBER, &interval, 1, 3600, "SECONDS"},
      {NULL, OPTION_FLAG, NULL, 0, 0, NULL},
  };
  int parsed = tool_parse(&top_command, options, argc, argv, NULL);
  if (parsed) return parsed < 0 ? 0 : parsed;
  static gca_ipc_device_t devices[MAX_DEVICES];
  bool refresh = !json && isatty(STDOUT_FILENO);
  for (;;) {
    int skipped = 0;
    int n = gca_ipc_scan_ex(devices, MAX_DEVICES, &skipped);
    if (n < 0) {
      fprintf(stderr, "gcalloc top: %s\n", gca_last_error());
      return 1;
    }
    if (n > MAX_DEVICES) n = MAX_DEVICES;
    if (json) print_json(devices, n, skipped);
    else {
      if (refresh) printf("\033[H\033[2J");
      print_table(devices, n, skipped);
      fflush(stdout);
    }
    if (!refresh) return 0;
    sleep((unsigned)interval);
  }
}
