"""Session-wide setup for the suite.

The Mosaic GPU interpreter runs each warpgroup of a multi-warpgroup kernel
(`delta_grads_pair.chunk_grads_pair`, `fused_streamed.streamed_walk`) as a
separate computation, and each of them blocks in its barrier
waits. These computations, and the one that launched them, run on XLA's CPU thread pool. That pool
has one thread per core (the `NPROC` environment variable overrides the count). On a 2-core machine
the launcher and one blocked warpgroup fill the pool. The warpgroup the blocked one waits for then
never starts, and the suite hangs.

Six threads leave room for the launcher and three warpgroups, with two to spare. The environment variable also reaches
the scripts that tests run as subprocesses. It is set here, before any test initialises JAX's CPU
backend.
"""

import os

os.environ["NPROC"] = str(max(6, int(os.environ.get("NPROC") or 0)))
