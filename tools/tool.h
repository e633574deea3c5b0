/* The subcommands of the gcalloc tool, each in its own file. */
#ifndef GCALLOC_TOOL_H
#define GCALLOC_TOOL_H

int demo_main(int argc, char **argv);
int bench_main(int argc, char **argv);
int bench_streams_main(int argc, char **argv);
int replay_main(int argc, char **argv);

#endif
