#!/bin/bash
# The tree the prepared commands run beside main's checkout (run from the repository root; untracked,
# never added): bn_tree/ = the branch block-norm-lane (the block norm kernels on main's code).
set -e
rm -rf bn_tree && mkdir bn_tree && git archive block-norm-lane | tar -x -C bn_tree
