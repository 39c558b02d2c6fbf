#!/bin/bash
# The trees the prepared commands run, beside main's checkout (run from the repository root; untracked,
# never added): lane_tree/ = the branch lane-semantics, bn_tree/ = the branch block-norm-kernels.
set -e
for pair in lane_tree:lane-semantics bn_tree:block-norm-kernels; do
  dir=${pair%%:*}; branch=${pair#*:}
  rm -rf "$dir" && mkdir "$dir" && git archive "$branch" | tar -x -C "$dir"
done
