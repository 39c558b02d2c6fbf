#!/bin/bash
# The trees v83's calls run beside the checkout (run from the repository root; untracked, never added):
# prev_tree/ = main before v83 (4ca4b10); bn_tree/ = the branch block-norm-lane (the block norm kernels).
set -e
rm -rf prev_tree bn_tree && mkdir prev_tree bn_tree
git archive 4ca4b10 | tar -x -C prev_tree
git archive block-norm-lane | tar -x -C bn_tree
