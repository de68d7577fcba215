# Sourced by tools/device_*.sh: the step runner and the summary they share. The caller sets OUT, the folder that
# comes back from the GPU machine (logs.txt there collects every step's log: the device tool returns few files),
# and may set STEP_LOGS, a folder where each step's own log stays for the caller to read after the steps.
SUMMARY=()
T0=${T0:-$SECONDS}

# The build and test tools, from the wheels carried in .whl/ where the image lacks them (the machine has no network).
install_carried_tools() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --find-links .whl scikit-build-core pybind11 cmake ninja pytest \
      > "$OUT/pip.log" 2>&1 || tail -5 "$OUT/pip.log"
  fi
}

run() {  # run NAME TIMEOUT CMD...: its log folded into $OUT/logs.txt; rc, seconds and its last result line into the summary
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS rc=0 log="${STEP_LOGS:-$OUT}/$name.log"
  echo "=== [+$((SECONDS - T0))s] $name: $*"
  timeout "$limit" "$@" > "$log" 2>&1 || rc=$?
  tail -n 25 "$log"
  SUMMARY+=("$(printf '%-14s rc=%-4s %5ss  %s' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -E 'passed|failed|PASS|FAIL|rror|ms/step|results:' "$log" | tail -1 | cut -c1-90)")")
  { echo "##### $name (rc=$rc)"; cat "$log"; } >> "$OUT/logs.txt"
  [[ -n "${STEP_LOGS:-}" ]] || rm -f "$log"
}

print_summary() {  # the machine, its jax, the run's seconds, then a line per step
  echo
  echo "=== summary ($(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null); jax" \
    "$(python3 -c 'import jax; print(jax.__version__)' 2>/dev/null); $((SECONDS - T0)) s)"
  printf '%s\n' "${SUMMARY[@]}"
}
