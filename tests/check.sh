# check.sh: the one check of the shell tests (cli.sh, install.sh, no-cuda.sh, wheel.sh), which
# source it; each ends with check_done. The output is matched with its trailing newlines, each
# turned into a space.

passed=0 failed=0

# check NAME STATUS PATTERN -- COMMAND...: COMMAND exits with STATUS and its stdout+stderr, newlines
# turned into spaces, matches the extended regex PATTERN (empty: anything).
check() {
  local name=$1 want=$2 pattern=$3 rc out start=$SECONDS
  shift 4
  out=$("$@" 2>&1; printf 'x%d' $?) # the status after a mark, so trailing newlines stay
  rc=${out##*x} out=${out%x*}
  if [[ $rc -eq $want ]] &&
    { [[ -z $pattern ]] || printf '%s' "$out" | tr '\n' ' ' | grep -Eq -- "$pattern"; }; then
    printf '%-4s %-48s %6ss\n' ok "$name" $((SECONDS - start))
    passed=$((passed + 1))
  else
    printf 'FAIL %s: exit %d (expected %d), output matching /%s/ expected:\n' "$name" "$rc" \
      "$want" "$pattern"
    tail -n 30 <<<"$out" | sed 's/^/    /'
    failed=$((failed + 1))
  fi
}

# "N passed, N failed", and the script's exit status: 1 if any failed.
check_done() {
  echo "$passed passed, $failed failed"
  [[ $failed -eq 0 ]]
}
