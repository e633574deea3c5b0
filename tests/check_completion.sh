#!/usr/bin/env bash
# The shell completion `gcalloc completion` prints (label core): commands
# from the tool's one table, a command's options from its own parser, and
# help's command names; each checked by completing as bash would.
# usage: check_completion.sh GCALLOC
set -euo pipefail
tool=$1
source <("$tool" completion)
complete_words() { # the words typed so far, the last being completed
  COMP_WORDS=("$@")
  COMP_CWORD=$(($# - 1))
  COMPREPLY=()
  _gcalloc
  echo "${COMPREPLY[*]}"
}
fail() { echo "FAIL: $*"; exit 1; }
[ "$(complete_words "$tool" ben)" = "bench bench-replay bench-streams bench-cuda bench-acl bench-sharing bench-pools" ] ||
  fail "commands starting with ben: $(complete_words "$tool" ben)"
[ "$(complete_words "$tool" re)" = "replay" ] || fail "re: $(complete_words "$tool" re)"
[ "$(complete_words "$tool" replay --ca)" = "--capacity" ] || fail "replay --ca: $(complete_words "$tool" replay --ca)"
[ "$(complete_words "$tool" tune --j)" = "--json" ] || fail "tune --j: $(complete_words "$tool" tune --j)"
[ "$(complete_words "$tool" help tu)" = "tune" ] || fail "help tu: $(complete_words "$tool" help tu)"
[ "$(complete_words "$tool" version --)" = "--help" ] || fail "version --: $(complete_words "$tool" version --)"
# Every command listed by --help is completed, and answers --list-options.
for c in $("$tool" --help | awk '/^  [a-z]/ {print $1}'); do
  [[ " $(complete_words "$tool" "") " == *" $c "* ]] || fail "$c is not completed"
  "$tool" "$c" --list-options | grep -qx -- --help || fail "$c --list-options"
done
echo "completion: commands, options and help's names complete"
