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

#include "gcalloc.h"
#include "tool.h"

#define MAX_DEVICES 64

static double mib(uint64_t bytes) { return (double)bytes / (1024.0 * 1024.0); }

static void print_json(const gca_ipc_device_t *d, int n) {
  printf("{\"devices\": [");
  for (int i = 0; i < n; i++) {
    printf("%s\n  {\"identity\": ", i ? "," : "");
    json_put_string(stdout, d[i].identity);
    printf(", \"total_bytes\": %" PRIu64 ", \"free_bytes\": %" PRIu64 ", \"other_bytes\": %" PRIu64
           ", \"processes\": [", d[i].total_bytes, d[i].free_bytes, d[i].other_bytes);
    for (int k = 0; k < d[i].peer_count; k++) {
      const gca_ipc_peer_t *p = &d[i].peers[k];
      printf("%s{\"pid\": %d, \"reserved_bytes\": %" PRIu64 ", \"allocated_bytes\": %" PRIu64
             ", \"cached_bytes\": %" PRIu64 ", \"waiting_bytes\": %" PRIu64 ", \"paused_bytes\": %" PRIu64
             ", \"requests\": %" PRIu64 ", \"bytes_received\": %" PRIu64 ", \"bytes_released\": %" PRIu64
             ", \"timeouts\": %" PRIu64 ", \"avoidable_ooms\": %" PRIu64 "}",
             k ? ", " : "", (int)p->pid, p->reserved_bytes, p->allocated_bytes, p->cached_bytes, p->waiting_bytes,
             p->paused_bytes, p->requests, p->bytes_received, p->bytes_released, p->timeouts, p->avoidable_ooms);
    }
    printf("]}");
  }
  printf("\n]}\n");
}

static void print_table(const gca_ipc_device_t *d, int n) {
  if (n == 0) printf("no process cooperates on a device (ipc_cooperation:True) on this host\n");
  for (int i = 0; i < n; i++) {
    printf("%s%s\n", i ? "\n" : "", d[i].identity);
    if (d[i].total_bytes)
      printf("  device: %.1f MiB, %.1f MiB free, %.1f MiB held outside these processes\n", mib(d[i].total_bytes),
             mib(d[i].free_bytes), mib(d[i].other_bytes));
    else
      printf("  device: its memory not yet known (no process here holds any)\n");
    printf("  %8s %13s %13s %13s %13s %13s %9s %13s %13s %9s %10s\n", "pid", "reserved MiB", "allocated MiB",
           "cached MiB", "waiting MiB", "paused MiB", "requests", "received MiB", "released MiB", "timeouts",
           "avoidable");
    for (int k = 0; k < d[i].peer_count; k++) {
      const gca_ipc_peer_t *p = &d[i].peers[k];
      printf("  %8d %13.1f %13.1f %13.1f %13.1f %13.1f %9" PRIu64 " %13.1f %13.1f %9" PRIu64 " %10" PRIu64 "\n",
             (int)p->pid, mib(p->reserved_bytes), mib(p->allocated_bytes), mib(p->cached_bytes),
             mib(p->waiting_bytes), mib(p->paused_bytes), p->requests, mib(p->bytes_received),
             mib(p->bytes_released), p->timeouts, p->avoidable_ooms);
    }
  }
}

const tool_command_t top_command = {
    "top", NULL, "[--json] [--interval SECONDS]",
    "the processes cooperating on each device: memory, waits, requests; the device's free memory",
    "\n"
    "The processes that share a device with ipc_cooperation:True (docs/sharing.md), per device: what each\n"
    "reserves, allocates, caches (could release) and waits for, its requests to the others so far (made,\n"
    "bytes received, bytes it released for theirs, peers that did not answer, avoidable out-of-memory\n"
    "errors), and the device's total and free memory with what is held outside these processes (by\n"
    "processes that do not cooperate, or the driver), as they last published it (every 100 ms).\n"
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
    int n = gca_ipc_scan(devices, MAX_DEVICES);
    if (n < 0) {
      fprintf(stderr, "gcalloc top: %s\n", gca_last_error());
      return 1;
    }
    if (n > MAX_DEVICES) n = MAX_DEVICES;
    if (json) print_json(devices, n);
    else {
      if (refresh) printf("\033[H\033[2J");
      print_table(devices, n);
      fflush(stdout);
    }
    if (!refresh) return 0;
    sleep((unsigned)interval);
  }
}
