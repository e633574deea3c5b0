# Shared by scripts/gpu-check.sh and scripts/npu-check.sh (sourced): run each
# step even when one before it failed, log it to $out/NAME.log, and say at
# the end which failed (`finish NAME` exits 1 if any did). ONLY="a b"
# runs just the steps named.
failed=()
step() { # name, command...
  local name=$1
  shift
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
    echo "=== $name: not in ONLY ==="
    return 0
  fi
  echo "=== $name ==="
  local t0=$SECONDS
  "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "--- $name: exit $rc, $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || failed+=("$name")
}
finish() { # name of the whole check
  if [ ${#failed[@]} -eq 0 ]; then
    echo "=== $1: all passed ==="
  else
    echo "=== $1: FAILED: ${failed[*]} ==="
    exit 1
  fi
}
