/* The gcalloc command-line tool.
 *
 *   gcalloc demo  [--backend SPEC] [--conf CONF] [--steps N] [--seed S]
 *       drive a training-like allocation sequence on a device (the simulated
 *       one by default) and print the statistics;
 *   gcalloc bench [--json] [--traces DIR] [--quick]
 *       time gcalloc against glibc, mimalloc and jemalloc (bench/bench.c);
 *   gcalloc bench-streams [--json] [--quick]
 *       peak reserved memory with and without cross-stream reuse on a
 *       multi-stream workload (bench/streams.c);
 *   gcalloc bench-replay [--traces DIR] [--runs N] [--json] [--speed-only] [--idle SECONDS]
 *       the replay's speed and peak reserved on the real traces (bench/replay.c);
 *   gcalloc bench-cuda [--json]
 *       the cuda backend against the driver's allocators on a real GPU
 *       (bench/cuda.c);
 *   gcalloc bench-acl [--json]
 *       the acl backend against AscendCL's allocation (bench/acl.c);
 *   gcalloc replay TRACE [--conf CONF] [--capacity SIZE] [--device N] [--json] [--report FILE.html]
 *                        [--no-empty-cache]
 *       replay a recorded trace on the simulated device (tools/replay.c,
 *       the HTML report: tools/report.c);
 *   gcalloc tune TRACE [--capacity SIZE] [--device N] [--json]
 *       search the settings for the least peak reserved (tools/tune.c);
 *   gcalloc bench-sharing [--json]
 *       processes on one device with and without cooperation (bench/sharing.c);
 *   gcalloc bench-pools [--json]
 *       the hot path's cost with private pools in use (bench/pools.c);
 *   gcalloc top [--json] [--interval SECONDS]
 *       the processes cooperating on each device (tools/top.c);
 *   gcalloc version
 *   gcalloc help [COMMAND]
 *
 * Every command takes -h/--help, and refuses what it does not know, naming
 * it (tools/common.c, tool_parse).
 */
#include <stdio.h>
#include <string.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "gcalloc.h"
#include "tool.h"

static const tool_command_t *const commands[] = {&demo_command,         &bench_command,      &bench_streams_command,
                                                 &bench_replay_command, &bench_cuda_command, &bench_acl_command, &replay_command,
                                                 &tune_command, &top_command, &bench_sharing_command,
                                                 &bench_pools_command};

/* Every command's usage line and summary, from the commands themselves. */
static void usage(FILE *out) {
  fprintf(out, "usage: gcalloc <command> [options]\n");
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    fprintf(out, "  %s %s\n        %s\n", commands[i]->name, commands[i]->usage, commands[i]->summary);
  fprintf(out, "  version\n"
               "'gcalloc COMMAND --help' (or 'gcalloc help COMMAND') says what each of its options does.\n");
}

/* `gcalloc help COMMAND`: COMMAND's own --help. */
static int help(int argc, char **argv) {
  if (argc < 3) {
    usage(stdout);
    return 0;
  }
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    if (!strcmp(argv[2], commands[i]->name)) {
      tool_help(commands[i]);
      return 0;
    }
  fprintf(stderr, "gcalloc help: no command '%s'\n", argv[2]);
  usage(stderr);
  return 2;
}

int main(int argc, char **argv) {
#if defined(__GLIBC__)
  /* The tool keeps the memory it frees, as a long-running process would:
   * a replay allocates and frees the same arrays (the plan, the simulated
   * device's tables) on two threads at once, and glibc gave them back to
   * the kernel after each (arrays from 128 KiB on are mappings of their
   * own, and heaps are trimmed), so the next took the pages' faults again,
   * serialized on the process's memory map: Constructor-Sun's replay after
   * a read took 0.7-1.9 ms instead of 0.5-0.6, a third of the time. `tune`
   * and the benchmark replay many times in one process; `replay` counts on
   * it to fault its heap in ahead (tools/replay.c, heap_warm). (The library
   * leaves malloc's settings to the program that links it.) */
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 128 << 20);
#endif
  if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (strcmp(argv[1], "help") == 0) return help(argc, argv);
  if (strcmp(argv[1], "demo") == 0) return demo_main(argc - 1, argv + 1);
  if (strcmp(argv[1], "bench") == 0) return bench_main(argc - 1, argv + 1);
  if (strcmp(argv[1], "bench-streams") == 0) return bench_streams_main(argc - 1, argv + 1);
  if (strcmp(argv[1], "replay") == 0) return replay_main(argc - 1, argv + 1);
  if (strcmp(argv[1], "bench-replay") == 0) return bench_replay_main(argc - 1, argv + 1);
  if (strcmp(argv[1], "bench-cuda") == 0) return bench_cuda_main(argc - 1, argv + 1);
  if (strcmp(argv[1], "bench-acl") == 0) return bench_acl_main(argc - 1, argv + 1);
  if (strcmp(argv[1], "top") == 0) return top_main(argc - 1, argv + 1);
  if (strcmp(argv[1], "bench-sharing") == 0) return bench_sharing_main(argc - 1, argv + 1);
  if (strcmp(argv[1], "bench-pools") == 0) return bench_pools_main(argc - 1, argv + 1);
  if (strcmp(argv[1], "tune") == 0) return tune_main(argc - 1, argv + 1);
  if (strcmp(argv[1], "version") == 0) {
    printf("gcalloc %s\n", gca_version());
    return 0;
  }
  fprintf(stderr, "gcalloc: unknown command '%s'\n", argv[1]);
  usage(stderr);
  return 2;
}
