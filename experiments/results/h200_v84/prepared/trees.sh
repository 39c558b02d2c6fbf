#!/bin/bash
# The tree of the prepared calls, run from the repository root before them (untracked, never added):
# l2_tree/ = this checkout's HEAD with prep_l2_halves.patch applied (kda's preparations sum the norms'
# squares over K's halves, NOTES.md v83 item 7, v84). Unmeasured changes are kept as patch files here:
# only main's history reaches the next checkout.
set -e
here=experiments/results/h200_v84/prepared
rm -rf l2_tree && mkdir l2_tree
git archive HEAD | tar -x -C l2_tree
git apply --directory=l2_tree "$here/prep_l2_halves.patch"
