#!/bin/bash
# Superseded (NOTES.md v84 item 2): the branches below did not reach later checkouts, so this script
# fails; experiments/results/h200_v84/prepared/ holds the same change as a patch and the calls that run it.
# The trees of the prepared next call (run from the repository root; untracked, never added):
# l2_tree/ = the branch prep-l2-halves (the preparations' norms over the halves, NOTES.md v83 item 7);
# bn_tree/ = the branch block-norm-lane (the block norm kernels, v82 item 5).
set -e
rm -rf l2_tree bn_tree && mkdir l2_tree bn_tree
git archive prep-l2-halves | tar -x -C l2_tree
git archive block-norm-lane | tar -x -C bn_tree
