/* The gcalloc command-line tool: `gcalloc COMMAND [options]`, the commands
 * listed once, in TOOL_COMMANDS (tool.h), each in a file of its own under
 * tools/ and bench/; this file dispatches to them and serves `version`,
 * `help` and `completion`. `gcalloc --help` lists them with their usage.
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

static int version_main(int argc, char **argv);
static int help_main(int argc, char **argv);
static int completion_main(int argc, char **argv);

static const tool_command_t version_command = {"version", NULL, "", "print gcalloc's version",
                                               "\nPrints the version of gcalloc (the library's, gca_version()).\n",
                                               version_main};
static const tool_command_t help_command = {
    "help", NULL, "[COMMAND]", "the list of commands, or what COMMAND's options do",
    "\nWithout COMMAND, the list of commands; with it, the same as 'gcalloc COMMAND --help'.\n", help_main};
static const tool_command_t completion_command = {
    "completion", NULL, "", "print a bash completion script for gcalloc",
    "\nPrints a bash script that completes gcalloc's commands and their options; load it with\n"
    "  source <(gcalloc completion)\n"
    "or save it as /usr/share/bash-completion/completions/gcalloc.\n",
    completion_main};

#define TOOL_ENTRY(name) &name##_command,
static const tool_command_t *const commands[] = {TOOL_COMMANDS(TOOL_ENTRY) & version_command, &help_command,
                                                 &completion_command};
#define COMMAND_COUNT (sizeof commands / sizeof commands[0])

/* Every command's usage line and summary, from the commands themselves. */
static void usage(FILE *out) {
  fprintf(out, "usage: gcalloc <command> [options]\n");
  for (size_t i = 0; i < COMMAND_COUNT; i++)
    fprintf(out, "  %s%s%s\n        %s\n", commands[i]->name, *commands[i]->usage ? " " : "", commands[i]->usage,
            commands[i]->summary);
  fprintf(out, "'gcalloc COMMAND --help' (or 'gcalloc help COMMAND') says what each of its options does.\n");
}

static const tool_command_t *command_named(const char *name) {
  for (size_t i = 0; i < COMMAND_COUNT; i++)
    if (!strcmp(name, commands[i]->name)) return commands[i];
  return NULL;
}

/* The commands that take only -h/--help. */
static int no_options(const tool_command_t *c, int argc, char **argv, const char **operand) {
  static const tool_option_t none[] = {{NULL, OPTION_FLAG, NULL, 0, 0, NULL}};
  return tool_parse(c, none, argc, argv, operand);
}

static int version_main(int argc, char **argv) {
  int rc = no_options(&version_command, argc, argv, NULL);
  if (rc) return rc < 0 ? 0 : rc;
  printf("gcalloc %s\n", gca_version());
  return 0;
}

static int help_main(int argc, char **argv) {
  if (argc < 2) {
    usage(stdout);
    return 0;
  }
  const tool_command_t *c = command_named(argv[1]);
  if (argc == 2 && c) {
    tool_help(c);
    return 0;
  }
  if (argc == 2 && (!strcmp(argv[1], "--list-options") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) {
    const char *operand;
    int rc = no_options(&help_command, argc, argv, &operand);
    return rc < 0 ? 0 : rc;
  }
  fprintf(stderr, "gcalloc help: no command '%s'\n", argv[1]);
  usage(stderr);
  return 2;
}

static int completion_main(int argc, char **argv) {
  int rc = no_options(&completion_command, argc, argv, NULL);
  if (rc) return rc < 0 ? 0 : rc;
  printf("# bash completion for gcalloc (gcalloc completion)\n"
         "_gcalloc() {\n"
         "  local cur=${COMP_WORDS[COMP_CWORD]}\n"
         "  if [ \"$COMP_CWORD\" -eq 1 ]; then\n"
         "    COMPREPLY=($(compgen -W \"");
  for (size_t i = 0; i < COMMAND_COUNT; i++) printf("%s%s", i ? " " : "", commands[i]->name);
  printf("\" -- \"$cur\"))\n"
         "  elif [ \"${COMP_WORDS[1]}\" = help ]; then\n"
         "    [ \"$COMP_CWORD\" -eq 2 ] && COMPREPLY=($(compgen -W \"");
  for (size_t i = 0; i < COMMAND_COUNT; i++) printf("%s%s", i ? " " : "", commands[i]->name);
  printf("\" -- \"$cur\"))\n"
         "  elif [[ $cur == -* ]]; then\n"
         "    COMPREPLY=($(compgen -W \"$(\"${COMP_WORDS[0]}\" \"${COMP_WORDS[1]}\" --list-options 2>/dev/null)\" -- "
         "\"$cur\"))\n"
         "  else\n"
         "    COMPREPLY=($(compgen -f -- \"$cur\"))\n"
         "  fi\n"
         "}\n"
         "complete -o filenames -F _gcalloc gcalloc\n");
  return 0;
}

int main(int argc, char **argv) {
#if defined(__GLIBC__)
  /* The tool keeps the memory it frees, as a long-running process would:
   * a replay allocates and frees the same arrays (the plan, the simulated
   * device's tables) on two threads at once, and glibc gave them back to
   * the kernel after each (arrays from 128 KiB on are mappings of their
   * own, and heaps are trimmed), so the next took the pages' faults again,
   * serialized on the process's memory map: a replay after a read took up
   * to three times as long. `tune`
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
  const tool_command_t *c = command_named(argv[1]);
  if (c) return c->run(argc - 1, argv + 1);
  fprintf(stderr, "gcalloc: unknown command '%s'\n", argv[1]);
  usage(stderr);
  return 2;
}
