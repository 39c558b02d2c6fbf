#!/bin/bash
# The trees of the prepared calls, run from the repository root before them (untracked, never added),
# each this checkout's HEAD with one patch of this folder applied (NOTES.md v84). Unmeasured changes are
# kept as patch files here: only main's history reaches the next checkout.
# l2_tree/: prep_l2_halves.patch (kda's preparations sum the norms' squares over K's halves, v83 item 7);
# maps_tree/: maps_two_per_sm.patch (the pieces' maps walk in ~107 KB, two programs an SM, v84 item 6).
set -e
here=experiments/results/h200_v84/prepared
for pair in l2_tree:prep_l2_halves maps_tree:maps_two_per_sm; do
  tree=${pair%%:*}
  rm -rf "$tree" && mkdir "$tree"
  git archive HEAD | tar -x -C "$tree"
  git apply --directory="$tree" "$here/${pair#*:}.patch"
done
