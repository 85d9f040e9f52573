#!/usr/bin/env bash
# ab.sh: compare builds of mok on the device with `mok bench`, interleaved, so that the GPU's
# drift (it behaves as power-bound, DESIGN.md §7) falls on every build alike.
#
#   tools/ab.sh build NAME REV   here: builds build/mok of git revision REV in a scratch worktree
#                                and keeps it as exp/NAME/mok (exp/ is ignored: carry it);
#                                make's variables pass through
#   tools/ab.sh bench            on the device: for each of $REPS rounds, each shape of $SHAPES,
#                                each build of $BUILDS (NAME, or "here" for ./build/mok), one
#                                `mok bench $ARGS`; a build NAME@A,B,... also passes A B ...,
#                                each with its = as a space (main@--cluster=4: the same mok with
#                                `--cluster 4`); logs under $OUT (or results/), a table last,
#                                with the mean SM clock and power while the GPU was busy (GPU 0's
#                                nvidia-smi samples every 50 ms with utilisation >= 90 %) and
#                                each run's fastest call (bench's min ms: the medians of short
#                                runs follow the clock's two levels, the minima much less;
#                                perf-log, 2026-12-04 at 5a66c9f)
#
# The table's bits column: "same" when a run repeated its own bits and gave the outputs of the
# shape's reference build (mok bench's "outputs fnv64", the same inputs for every build), which
# is the first in $BUILDS whose run repeated its bits and printed a hash; "other than B" when its
# outputs differ from reference build B's; "not repeated" when its own timed runs differed; "no
# digest" for a mok from before bench printed one. So every A/B also checks the output bits.
#
# Defaults: BUILDS="here", SHAPES="mixtral-8x7b", REPS=2, ARGS="--warmup 3 --repeat 20";
# EXP=exp, where the named builds are (relative to the repository root, or absolute).
set -euo pipefail
cmd=${1:-}
case "$cmd" in
build)
  [ $# -eq 3 ] || { echo "usage: tools/ab.sh build NAME REV" >&2; exit 2; }
  name=$2 rev=$3 top=$(git rev-parse --show-toplevel)
  tree=$(mktemp -d /tmp/mok-ab-XXXXXX)
  git -C "$top" worktree add -f --detach "$tree" "$rev" > /dev/null
  trap 'git -C "$top" worktree remove -f "$tree"' EXIT
  make -C "$tree" -j"$(nproc)" build/mok > "$tree.log" 2>&1 || { tail -20 "$tree.log"; exit 1; }
  dest=${EXP:-exp}
  case $dest in /*) ;; *) dest=$top/$dest ;; esac
  mkdir -p "$dest/$name"
  cp "$tree/build/mok" "$dest/$name/mok"
  echo "$dest/$name/mok: $(git -C "$top" rev-parse --short "$rev")"
  ;;
bench)
  # The NCCL that mok was built against, as tools/gpu-check.sh finds it (needed from --ep on).
  wheel=$(python3 -c "import nvidia.nccl as n; print(n.__path__[0])" 2>/dev/null || true)
  if [ -n "$wheel" ] && [ -e "$wheel/lib/libnccl.so.2" ]; then
    export LD_LIBRARY_PATH=$wheel/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
  out=${OUT:-results}/ab
  mkdir -p "$out"
  smi=
  trap 'if [ -n "$smi" ]; then kill "$smi" 2> /dev/null || true; fi' EXIT
  read -r -a args <<< "${ARGS:---warmup 3 --repeat 20}"
  table="$out/table.md"
  declare -A ref_digest ref_build # per shape: the reference build's outputs hash, and its name
  echo "| round | shape | build | fwd ms | bwd ms | bits | SM MHz | W | fwd min | bwd min |" \
    > "$table"
  echo "|---|---|---|---:|---:|---|---:|---:|---:|---:|" >> "$table"
  for r in $(seq "${REPS:-2}"); do
    for shape in ${SHAPES:-mixtral-8x7b}; do
      for b in ${BUILDS:-here}; do
        name=${b%%@*} extra=()
        if [ "$name" != "$b" ]; then IFS=', ' read -r -a extra <<< "$(tr '=' ' ' <<< "${b#*@}")"; fi
        bin=./build/mok
        [ "$name" = here ] || bin=${EXP:-exp}/$name/mok
        log="$out/$(tr '@,=' '_' <<< "$b")-$shape-$r.log"
        rc=0 smi=
        : > "$log.smi"
        if command -v nvidia-smi > /dev/null; then
          nvidia-smi -i 0 --query-gpu=clocks.sm,power.draw,utilization.gpu \
            --format=csv,noheader,nounits -lms 50 > "$log.smi" 2> /dev/null &
          smi=$!
        fi
        "$bin" bench --shape "$shape" "${args[@]}" "${extra[@]}" > "$log" 2>&1 || rc=$?
        if [ -n "$smi" ]; then kill "$smi" 2> /dev/null || true; wait "$smi" 2> /dev/null || true; fi
        fwd=$(awk '$1 == "forward" {print $2; exit}' "$log")
        bwd=$(awk '$1 == "backward" {print $2; exit}' "$log")
        mins=$(awk '$1 == "forward" && !f {f = $3} $1 == "backward" && !b {b = $3}
                    END {printf "%s | %s", f, b}' "$log")
        if [ -z "$fwd" ] || [ -z "$bwd" ]; then
          echo "| $r | $shape | $b | failed (exit $rc) | see $log | | | | | |" | tee -a "$table"
          continue
        fi
        digest=$(awk '$1 == "outputs" && $2 == "fnv64:" {print $3; exit}' "$log")
        if ! grep -q "repeated bits: identical" "$log"; then bits="not repeated"
        elif [ -z "$digest" ]; then bits="no digest" # a mok from before bench printed one
        else
          if [ -z "${ref_digest[$shape]:-}" ]; then ref_digest[$shape]=$digest ref_build[$shape]=$b; fi
          if [ "$digest" = "${ref_digest[$shape]}" ]; then bits=same
          else bits="other than ${ref_build[$shape]}"; fi
        fi
        busy=$(awk -F', *' '$3 + 0 >= 90 {c += $1; p += $2; n++}
                            END {if (n) printf "%.0f | %.0f", c / n, p / n; else print "- | -"}' \
               "$log.smi")
        echo "| $r | $shape | $b | $fwd | $bwd | $bits | $busy | $mins |" | tee -a "$table"
      done
    done
  done
  echo
  cat "$table"
  ;;
*)
  awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
  exit 2
  ;;
esac
